"""The prefill queue: strict priority classes, each a kinetic index."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from itertools import chain

from medha_sched.policies.base import Policy
from medha_sched.priority_index import KineticIndex
from medha_sched.request import Request


class PrefillQueue:
    """Requests with prompt tokens left to issue, in policy order.

    A more important class (lower ``priority``) always comes first; inside a
    class the policy's time-dependent key decides, ties by arrival then order
    of insertion.

    Requests with fewer than ``short_below`` prompt tokens left to issue (as
    of their latest ``push``) are counted by that number, so a scan can tell
    at once that no such request waits (:meth:`has_remaining_below`); those
    whose prompt is shorter than ``long_min`` tokens (as of their latest
    ``push``) are kept as a set (``_not_long``; none with the default 0).
    """

    def __init__(self, policy: Policy, *, short_below: int = 0, long_min: int = 0) -> None:
        self._policy = policy
        self._classes: dict[int, KineticIndex[str]] = {}
        self._where: dict[str, int] = {}
        self._requests: dict[str, Request] = {}
        self._seq = 0
        self._short_below = short_below
        self._short: dict[str, int] = {}  # request id -> tokens left, below short_below
        self._long_min = long_min
        self._not_long: set[str] = set()  # ids of prompts shorter than long_min

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._where

    def push(self, request: Request) -> None:
        """Insert, or refresh the key of a request whose progress changed."""
        intercept, slope = self._policy.line(request)
        rid = request.request_id
        self._note(request)
        if rid in self._where:
            self._classes[self._where[rid]].update(rid, intercept=intercept, slope=slope)
            return
        index = self._classes.get(request.priority)
        if index is None:  # not setdefault: that would build an index on every push
            index = self._classes[request.priority] = KineticIndex()
        self._seq += 1
        index.add(rid, intercept=intercept, slope=slope, tiebreak=(request.arrival_time, self._seq))
        self._where[rid] = request.priority
        self._requests[rid] = request

    def renew(self, request: Request) -> None:
        """:meth:`remove` then :meth:`push` of a queued request (a new insertion,
        with the next tie-break), the index repaired once where it can be."""
        rid = request.request_id
        priority = self._where[rid]
        if priority == request.priority:
            intercept, slope = self._policy.line(request)
            seq = self._seq + 1
            if self._classes[priority].renew(
                rid, intercept=intercept, slope=slope, tiebreak=(request.arrival_time, seq)
            ):
                self._seq = seq
                self._note(request)
                return
        self.remove(rid)
        self.push(request)

    def _note(self, request: Request) -> None:
        """Track ``request`` among the short prompts by the prompt it has left,
        and among those not long by its prompt."""
        rid = request.request_id
        prompt = request.num_prefill_tokens
        lane = request._lane  # num_scheduled_tokens, without the property's call:
        left = prompt - (request._scheduled if lane is None else request._scheduled + lane.issued)
        if left < self._short_below:
            self._short[rid] = left
        else:
            self._short.pop(rid, None)
        if prompt < self._long_min:
            self._not_long.add(rid)
        else:
            self._not_long.discard(rid)

    def only(self) -> Request:
        """The one queued request (the queue must hold exactly one)."""
        assert len(self._requests) == 1, "the queue holds more or fewer than one request"
        return next(iter(self._requests.values()))

    def count_pushes(self, count: int) -> None:
        """Number ``count`` insertions that were taken out again before anyone
        looked (bulk turns of a lone prefill): later insertions get the
        tie-breaks they would have had."""
        self._seq += count

    def remove(self, request_id: str) -> None:
        if request_id in self._where:
            self._classes[self._where.pop(request_id)].remove(request_id)
            del self._requests[request_id]
            self._short.pop(request_id, None)
            self._not_long.discard(request_id)

    def remove_many(self, request_ids: Iterable[str]) -> None:
        """:meth:`remove` each of ``request_ids`` (distinct; one not queued is
        skipped), each class's index repaired once for all of its removals."""
        where, requests, short, not_long = self._where, self._requests, self._short, self._not_long
        by_class: dict[int, list[str]] = {}
        for rid in request_ids:
            priority = where.pop(rid, None)
            if priority is None:
                continue
            del requests[rid]
            short.pop(rid, None)
            not_long.discard(rid)
            ids = by_class.get(priority)
            if ids is None:
                by_class[priority] = [rid]
            else:
                ids.append(rid)
        for priority, ids in by_class.items():
            self._classes[priority].remove_many(ids)

    def has_remaining_below(self, tokens: int, met: Collection[str] = ()) -> bool:
        """Whether a queued request had fewer than ``tokens`` prompt tokens left
        when it was pushed (``tokens`` at most ``short_below``), the ids in
        ``met`` left out (a scan's candidates so far: it meets none again)."""
        assert tokens <= self._short_below, "only short requests are counted"
        short = self._short
        if not short or min(short.values()) >= tokens:
            return False
        return not met or any(left < tokens and rid not in met for rid, left in short.items())

    def first(self, now: float) -> Request | None:
        """The first request of :meth:`iter_sorted` at ``now`` (None: empty), without
        the enumeration: the winner of its class's index once advanced to ``now``."""
        classes = self._classes
        for priority in sorted(classes) if len(classes) > 1 else classes:
            rid = classes[priority].peek(now)
            if rid is not None:
                return self._requests[rid]
        return None

    def iter_sorted(self, now: float) -> Iterator[Request]:
        """Requests in service order at time ``now``; do not mutate while iterating."""
        # chain and map keep the per-item work in C; each class is advanced
        # only when the iteration reaches it, as with nested loops
        request_of = self._requests.__getitem__
        classes = self._classes
        if len(classes) == 1:  # one class (the common case): no chain to walk through
            (index,) = classes.values()
            return map(request_of, index.iter_sorted(now))
        return chain.from_iterable(
            map(request_of, classes[priority].iter_sorted(now)) for priority in sorted(classes)
        )


class ScanCursor:
    """A scan's candidates: the requests of :meth:`PrefillQueue.iter_sorted`
    at one time, in its order, with a way to pass over the long prompts up to
    the next short one without walking to them (a scan that knows every long
    prompt is blocked and would only count them).

    Iterating yields each request, or None for a place the cursor knows to
    hold a long prompt it has not walked to (only after :meth:`pass_over`);
    :meth:`resolve` then walks there. The places of the short prompts come
    from ``places`` (``{place: request}`` of every one of them, or None when
    they cannot be told: then nothing is passed over), called once, when
    first needed.
    """

    __slots__ = ("_ahead", "_at", "_places", "_shorts", "_size", "_walk", "_walked", "passed")

    def __init__(
        self,
        walk: Iterator[Request],
        size: int,
        places: Callable[[], dict[int, Request] | None],
    ) -> None:
        self._walk = walk
        self._size = size  # how many requests the walk yields
        self._places = places
        self._shorts: dict[int, Request] | None = None  # place -> short prompt
        self._ahead: list[int] | None = None  # their places, in order (None: not known)
        self._at = 0  # places met or passed over
        self._walked = 0  # places the walk has yielded
        self.passed = False  # some place was passed over: iterate the cursor, not the walk

    def __iter__(self) -> ScanCursor:
        return self

    def __next__(self) -> Request | None:
        at = self._at
        if at == self._walked:  # the walk is here
            r = next(self._walk)
            self._walked = self._at = at + 1
            return r
        if at >= self._size:
            raise StopIteration
        self._at = at + 1
        assert self._shorts is not None  # (places passed over: they are known)
        return self._shorts.get(at)  # a short prompt, or None: a long one

    def resolve(self) -> Request:
        """The request at the place last yielded as None, walked to."""
        at = self._at - 1
        walk = self._walk
        for _ in range(at - self._walked):
            next(walk)
        self._walked = at + 1
        return next(walk)

    def longs_ahead(self) -> tuple[int, bool]:
        """``(k, short)``: the next ``k`` places hold long prompts, and a short
        prompt follows them (else the queue ends); ``(0, False)`` when the
        places of the short prompts cannot be told."""
        ahead = self._ahead
        if ahead is None:
            if self._shorts is not None:
                return 0, False  # asked before: not told
            shorts = self._places()
            self._shorts = {} if shorts is None else shorts
            if shorts is None:
                return 0, False
            ahead = self._ahead = sorted(shorts)
        at = self._at
        for place in ahead:
            if place >= at:
                return place - at, True
        return self._size - at, False

    def met_first(self) -> None:
        """The caller met the first place itself; the walk has yielded nothing
        (it is walked from there on :meth:`resolve`)."""
        assert self._at == 0 and self._walked == 0, "the cursor has moved"
        self._at = 1

    def pass_over(self, k: int) -> None:
        """Pass over the next ``k`` places (long prompts, by :meth:`longs_ahead`)."""
        self._at += k
        self.passed = True

    def sync(self, taken: int) -> None:
        """The caller has taken ``taken`` requests from the walk itself (none
        passed over yet)."""
        assert not self.passed, "places were passed over: iterate the cursor"
        self._at = self._walked = taken
