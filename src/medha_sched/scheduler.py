"""The scheduler: requests in, plain-data batches out.

``schedule(now)`` forms one batch (a frozen :class:`ScheduleOutput`);
``on_stage_end`` says a batch cleared pipeline stage 0 (a prefill's next
chunk may then be issued); ``on_batch_end`` brings the results back. Nothing
here knows about tensors.

A step costs what changed, not what exists: the running decodes sit in
lanes (:mod:`medha_sched.decode_set`) that price them in O(1), check KV
capacity only for those crossing a block boundary, and hand them to the
executor as a difference from the batch they continue. The prefill scan
touches only the candidates it examines (:mod:`medha_sched.priority_index`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial

from medha_sched.batch_cost import BatchCost, chunk_works
from medha_sched.chunking import chunk_search
from medha_sched.config import CacheConfig, SchedulerConfig
from medha_sched.cost.base import AggregateCostModel, CostModel
from medha_sched.decode_run import (
    decode_run_limit,
    kv_fits,
    plan_decode_run,
    plan_lane_run,
)
from medha_sched.decode_set import ZERO_TOKENS, DecodeLanes, Lane, Member
from medha_sched.errors import RequestTooLongError, SchedulerError
from medha_sched.kv_memory import KVBlockManager
from medha_sched.output import BatchResult, BlockGrant, ScheduledChunk, ScheduleOutput
from medha_sched.packer import ChunkSizer, Draft
from medha_sched.policies import get_policy
from medha_sched.policies.base import Policy
from medha_sched.prefill_cache import PrefillTimeCache
from medha_sched.prefix_hash import extend_stream_hashes, extend_token_hashes
from medha_sched.queue import PrefillQueue, ScanCursor
from medha_sched.request import Request, RequestStatus

_NO_TOKENS = BatchResult()
_INF = float("inf")
_MISSING = object()


def _check_token(request_id: str, token: object) -> None:
    """SchedulerError unless ``token`` is an integer (a bool is not); checked before the
    result changes anything, so a rejected result leaves its batch in flight."""
    try:
        operator.index(token)
    except TypeError:
        ok = False
    else:
        ok = not isinstance(token, bool)
    if not ok:
        raise SchedulerError(
            f"batch result's token for request {request_id!r} must be an integer, got {token!r}"
        )


def _round_robin_counts(counts: list[int]) -> list[int]:
    """Turns worth pricing per lane of a lane cycle that may take ``counts``:
    the turns go round robin (issue ``i`` of ``lanes[i % k]``) and stop at the
    first lane out of them, so no lane gets more than one past the fewest."""
    most = min(counts) + 1
    return [c if c < most else most for c in counts]


@dataclass(frozen=True, slots=True)
class LaneCycle:
    """Decode-only batches certain to come while decodes are in flight (a plan).

    When no prompt waits and every batch in flight is decode-only, the ready
    decodes (one lane) and the lanes in flight take turns: each is issued
    again once its batch has ended and stage 0 is free. The executor (the
    simulator's pipeline) decides when; the scheduler only prices.

    Attributes:
        lanes: the ready lane first, then the lanes in flight in issue order;
            issue ``i`` of the cycle is of ``lanes[i % len(lanes)]``.
        in_flight: the batch ids in flight now, in issue order (of ``lanes[1:]``).
        sizes: decodes in each lane.
        times: predicted seconds of each lane's next issues, at most as many as
            are certain (none finishes a request before it ends, none needs a
            preemption or a new KVP shard).
    """

    lanes: list[Lane]
    in_flight: list[int]
    sizes: list[int]
    times: list[list[float]]


class _PrefillQueue(PrefillQueue):
    """The prefill queue, also counting the queued requests whose prompt (as
    of their latest ``push``) is shorter than ``long_min`` tokens (the base
    class keeps them): a scan that met all of them knows every candidate
    left is a long prefill.

    The chunks a scan chose leave it by :meth:`take`, which defers their
    removal from the index to the next queue operation: most often that is
    the ``push`` of one of them when its batch clears stage 0, and a
    ``remove`` then ``push`` of the same request is one in-place renewal
    (:meth:`KineticIndex.renew`) when that leaves the index as the pair
    would. Any other operation first removes what is deferred, in the order
    taken, so the index goes through the same states as with
    :meth:`remove_many` at the scan, but for stale certificate entries and
    :meth:`KineticIndex.count_ahead`'s margin bounds: an in-place renewal
    neither empties an index nor pushes the events that time its
    compactions, so those bounds may stay higher than the remove-then-push
    path leaves them. They still cover every live line (``check()``), so
    :meth:`ahead_of_not_long` stays a sound lower bound, and the scan's stop
    on it, taken or not, forms the same batch.
    """

    # The overrides call PrefillQueue's methods by name, not through super():
    # a super object per call cost about 0.2 us (Python 3.11), and renew and
    # first run at every prefill turn.

    def __init__(self, policy: Policy, *, short_below: int, long_min: int) -> None:
        super().__init__(policy, short_below=short_below, long_min=long_min)
        self._out: list[str] = []  # taken (out of the queue), still in the index

    def __len__(self) -> int:
        return len(self._where) - len(self._out)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._where and request_id not in self._out

    @property
    def num_not_long(self) -> int:
        """Queued requests with fewer than ``long_min`` prompt tokens to prefill."""
        if self._out:
            self._flush()
        return len(self._not_long)

    def take(self, request_ids: list[str]) -> None:
        """:meth:`remove_many` of ``request_ids`` (distinct, queued), deferred:
        they are out of the queue now (``len``, ``in``), and out of the index
        at the next operation but a ``push`` renewing one of them in place.
        The list is kept (and emptied): do not reuse it."""
        if self._out:
            self._flush()
        self._out = request_ids

    def _flush(self) -> None:
        """Remove what :meth:`take` deferred, in the order taken."""
        out, self._out = self._out, []
        PrefillQueue.remove_many(self, out)

    def push(self, request: Request) -> None:
        if self._out:
            if request.request_id in self._out and self._renew_taken(request):
                return
            self._flush()
        PrefillQueue.push(self, request)

    def _renew_taken(self, request: Request) -> bool:
        """``push`` of a taken ``request`` as one renewal in the index, if that ends
        as the deferred removals then the push would (then True): no request
        taken after it shares its slot's page (that one's freed slot would be
        the one the push takes), and the index's :meth:`~KineticIndex.renew`
        keeps its slot (its slot's page keeps a free slot and is the one for
        its new slope) or, no other request of its priority class being
        taken, moves it where the pair would. The other taken requests stay
        deferred."""
        rid = request.request_id
        out, where = self._out, self._where
        at = out.index(rid)
        priority = where[rid]
        if priority != request.priority:
            return False
        index = self._classes[priority]
        later = [x for x in out[at + 1 :] if where[x] == priority]
        if later and index.shares_page(rid, later):
            return False
        # alone in its index's deferred removals, the pair may move it to another slot
        move = not later and all(where[x] != priority for x in out[:at])
        intercept, slope = self._policy.line(request)
        seq = self._seq + 1
        if not index.renew(
            rid, intercept=intercept, slope=slope, tiebreak=(request.arrival_time, seq), move=move
        ):
            return False
        self._seq = seq
        del out[at]
        self._requests[rid] = request  # as the push would store it
        self._note(request)
        return True

    def remove(self, request_id: str) -> None:
        if self._out:
            self._flush()
        PrefillQueue.remove(self, request_id)

    def remove_many(self, request_ids: Iterable[str]) -> None:
        if self._out:
            self._flush()
        PrefillQueue.remove_many(self, request_ids)

    def renew(self, request: Request) -> None:
        if self._out:
            self._flush()
        PrefillQueue.renew(self, request)

    def count_pushes(self, count: int) -> None:
        if self._out:
            self._flush()
        PrefillQueue.count_pushes(self, count)

    def only(self) -> Request:
        if self._out:
            self._flush()
        return PrefillQueue.only(self)

    def has_remaining_below(self, tokens: int, met: Collection[str] = ()) -> bool:
        if self._out:
            self._flush()
        return PrefillQueue.has_remaining_below(self, tokens, met)

    def first(self, now: float) -> Request | None:
        if self._out:
            self._flush()
        classes = self._classes
        if len(classes) == 1:  # PrefillQueue.first's loop, for its one class
            for index in classes.values():
                rid = index.peek(now)
                return None if rid is None else self._requests[rid]
        return PrefillQueue.first(self, now)

    def iter_sorted(self, now: float) -> Iterator[Request]:
        if self._out:
            self._flush()
        return PrefillQueue.iter_sorted(self, now)

    def scan_cursor(self, walk: Iterator[Request], now: float) -> ScanCursor:
        """``walk``, :meth:`iter_sorted` at ``now``, as a :class:`ScanCursor`,
        which may pass over long prompts: the places of the prompts that are
        not long are told by the keys (:meth:`KineticIndex.places`) with one
        priority class queued."""
        return ScanCursor(walk, len(self), partial(self._not_long_places, now))

    def _not_long_places(self, now: float) -> dict[int, Request] | None:
        classes = self._classes
        if len(classes) != 1:
            return None
        (index,) = classes.values()
        places = index.places(self._not_long, now)
        if places is None:
            return None
        requests = self._requests
        return {place: requests[rid] for place, rid in places.items()}

    def ahead_of_not_long(self, request_ids: Iterable[str], now: float) -> int:
        """How many distinct queued requests of ``request_ids`` ``iter_sorted(now)``
        surely yields before every request that is not long
        (:meth:`KineticIndex.count_ahead`); 0 with requests of more than one
        priority class queued (a class once used and now empty does not count)."""
        if self._out:
            self._flush()
        classes = self._classes
        if len(classes) == 1:  # the one class (the common case), without the list
            for index in classes.values():
                return index.count_ahead(request_ids, self._not_long, now) if len(index) else 0
        live = [index for index in classes.values() if len(index)]
        if len(live) != 1:
            return 0
        return live[0].count_ahead(request_ids, self._not_long, now)


def _lane_sums(
    nt: int, kv: int, line_a: list[float], line_b: list[float], const: list[float] | None
) -> list[float]:
    """A one-group lane's sums of features (``DecodeLanes.totals``' row): ``nt * a +
    kv * b`` term by term, plus ``const`` if any (a function, not a comprehension
    in :meth:`Scheduler.turn_run`, whose ``nt`` and ``kv`` would become cells)."""
    if const is None:
        return [nt * x + kv * y for x, y in zip(line_a, line_b, strict=True)]
    return [nt * x + kv * y + c for x, y, c in zip(line_a, line_b, const, strict=True)]


_END = object()
"""The end of a scan's candidates (None is a long prompt passed over)."""


def _walk(queue: PrefillQueue, now: float) -> Iterator[Request]:
    """``queue.iter_sorted(now)``, called at the first step (a joined scan may
    end, or pass over the long prompts, without walking)."""
    yield from queue.iter_sorted(now)


@dataclass(slots=True)
class TurnRun:
    """Prefill turns taken at once by :meth:`Scheduler.turn_run` (one per stage-0
    clearing, as the per-turn path issues them).

    Attributes:
        ids: the turns' batch ids, in issue order.
        starts: each turn's issue time.
        chunks: each turn's prefill tokens (its chunk; two chunks for a scan's pair).
        prefills: each turn's prefill chunks (1, or 2 for a scan's pair).
        times: each turn's predicted seconds.
        decodes: each turn's decodes.
        ends: when each turn's batch leaves the pipeline.
        next_start: when the last turn clears stage 0 (the next turn's time).
        ended: of the batches in flight before the run, how many ended (the oldest).
        ended_turns: of the turns, how many ended (the first ones).
        cleared: the last turn cleared stage 0 (else its stage-0 end is at or
            after the horizon, and the run stopped there).
        plain: a batch the scan formed at ``next_start`` that is no turn (one of
            its chunks samples), issued after the turns as
            :meth:`Scheduler.schedule_plain` returns it; the run stopped there.
    """

    ids: range
    starts: list[float]
    chunks: list[int]
    prefills: list[int]
    times: list[float]
    decodes: list[int]
    ends: list[float]
    next_start: float
    ended: int
    ended_turns: int
    cleared: bool
    plain: tuple[int, float, int, list[tuple[str, int, bool]], int] | None = None


@dataclass(slots=True)
class _InFlight:
    entries: list[tuple[Request, int, int, bool]]  # prefills: request, start, tokens, samples
    lane: Lane | None = None  # the decodes
    stage0_cleared: bool = False


class Scheduler:
    """Medha's replica scheduler.

    Args:
        config: batching policy and budget.
        cost_model: predicts iteration times; its ``layout`` gives tp/spp/kvp.
        cache: KV memory per KVP group.
    """

    _lane_time_late = True
    """:meth:`turn_run` prices a lane alone in a turn only where it must (see there);
    False: at every turn, before the chunk (the tests' reference)."""

    def __init__(
        self, config: SchedulerConfig, cost_model: CostModel, *, cache: CacheConfig | None = None
    ) -> None:
        self.config = config
        self.cost_model = cost_model
        self.cache = cache if cache is not None else CacheConfig()
        self.layout = cost_model.layout
        self.policy = get_policy(config.policy)
        self.memory = KVBlockManager(self.cache, num_groups=self.layout.kvp)
        self.group_limit = self.cache.group_token_limit
        #: the longest prefill memory ever admits with the watermark (max_admit_tokens)
        self._max_admit = self.memory.max_admit_tokens
        table = {
            "target_time": config.target_batch_time,
            "token_grid": config.token_grid,
            "max_chunk_tokens": config.max_chunk_tokens,
            "group_token_limit": self.group_limit,
        }
        self.prefill_times = PrefillTimeCache(cost_model, **table)
        # Which prompts can be prefilled at all is a property of the
        # configuration, decided by the model as it is now: a learning model
        # that meets a busy device must not start refusing prompts.
        frozen = getattr(cost_model, "frozen", None)
        self._feasibility = (
            PrefillTimeCache(frozen(), **table)
            if callable(frozen) and hasattr(cost_model, "revision")
            else self.prefill_times
        )
        self._sizer = ChunkSizer(config, self.policy, self.group_limit)
        self._adaptive = config.adaptive
        self._queue = _PrefillQueue(
            self.policy, short_below=config.token_grid, long_min=config.long_prefill_threshold
        )
        self._requests: dict[str, Request] = {}
        self._running: dict[str, Request] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._abort_pending: set[str] = set()
        self._next_batch_id = 0
        self._clock = float("-inf")
        self.num_preemptions = 0
        self._lanes = DecodeLanes(cost_model, self.memory)
        self._async = config.async_decodes
        # async_decodes: per lane, the members that joined it while a batch of it
        # was in flight (they get no token when that batch ends)
        self._fresh: dict[Lane, dict[str, Member]] = {}
        self._seq = 0  # admissions so far: a running request's place in the running order
        self._seq_of: dict[str, int] = {}
        # per-token latency targets of running requests past their prefill
        self._tpot: dict[str, float] = {}
        # turns of long prompts waiting together: those that left the queue at
        # a turn whose batch has not cleared stage 0 (still in the index)
        # (in the order they left; a dict: removed in that order at the end of the turns)
        self._turn_out: dict[str, None] = {}
        # the candidates the latest scan past its first one met, in order, if
        # all were long prefills: those still queued usually still come before
        # every other prompt (see _pack_prefills)
        self._walked: list[str] = []
        #: batches the scan forms while prompts wait together may go as turns
        #: (:meth:`scan_turns`, :meth:`turn_run`); False: only prompts' turns (a
        #: simulator compares the two)
        self.turn_scans = True
        self._caching = self.cache.enable_prefix_caching
        # prefill turns price their batch from summed features without a draft
        # when one KVP group holds everything (ChunkSizer.adaptive_alone)
        self._one_group = (
            cost_model
            if isinstance(cost_model, AggregateCostModel) and self.layout.kvp == 1
            else None
        )
        # drafts price one-group tail probes in one call when the model can (the
        # same floats; a model's chunk_price is fixed for its life)
        self._draft_price = None if self._one_group is None else self._one_group.chunk_price()
        self._empty_cost = self._cost_template()  # _new_draft's batches: its empty() copies
        # turn_run's decode-lane times by number of decodes (see _decode_time_of),
        # for the model's revision they were made at
        self._decode_times: dict[int, Callable[[float, float], float]] = {}
        self._decode_times_revision = getattr(cost_model, "revision", 0)
        # prefix cache lookups at admission, in prompt tokens (vLLM's counters)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def __getstate__(self) -> dict:
        """Pickled without the drafts' chunk pricer (a closure); :meth:`__setstate__`
        asks the model for it again (the same floats)."""
        state = self.__dict__.copy()
        state["_draft_price"] = state["_empty_cost"] = None
        state["_decode_times"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        agg = self._one_group
        self._draft_price = None if agg is None else agg.chunk_price()
        self._empty_cost = self._cost_template()
        self._decode_times = {}  # (made again on demand; pickled before it was kept)
        self._decode_times_revision = getattr(self.cost_model, "revision", 0)

    # ----------------------------------------------------------------- intake
    @property
    def max_context_tokens(self) -> int:
        """Most tokens (prompt + output) one request may ever hold."""
        return self.layout.kvp * self.group_limit

    @property
    def max_admit_tokens(self) -> int:
        """Longest prefill KV memory admits with the watermark left free (whole-prompt
        reservation). A preempted request that has grown past it is admitted
        without the watermark, and is no victim while another can be preempted."""
        return self._max_admit

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt that can be admitted (whole-prompt reservation)."""
        prompt = self.max_admit_tokens
        if self.config.adaptive:
            prompt = min(prompt, self._feasibility.max_feasible_tokens)
        return int(prompt)

    def add_request(self, request: Request) -> None:
        """Accept a new request; its deadline is fixed here for good."""
        rid = request.request_id
        if rid in self._requests:
            raise SchedulerError(f"request id {rid!r} is already in the scheduler")
        # Pricing the prompt first extends the prefill tables to its length, so
        # the feasibility check below sees every position the prompt covers.
        p = self.prefill_times.remaining_time(request.num_prefill_tokens, 0)
        if self._feasibility is not self.prefill_times:
            self._feasibility.prefill_time(request.num_prefill_tokens)
        self._check_fits(request)
        if self._caching and not self.cache.block_ids:
            self._check_no_prefix(request)
        if self._caching and self.config.cache_aware_slack:
            # only the uncached part is work (the hit is a look: admission may find less)
            cached = self.memory.cached_prefix_tokens(
                self._lookup_hashes(request), request.num_prefill_tokens
            )
            if cached:
                p = self.prefill_times.remaining_time(request.num_prefill_tokens, cached)
        if request.ttft_slo is not None:
            d = request.ttft_slo
        else:
            d = max(self.config.deadline_multiplier * p, self.config.min_deadline)
        request.deadline = request.arrival_time + d
        request.total_work = request.remaining_work = p
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self._queue.push(request)

    def _check_no_prefix(self, request: Request) -> None:
        """SchedulerError if ``request`` carries prefix content to share while
        blocks are only counted (nothing could be shared without block ids)."""
        if request.prefix_caching and (
            request.prompt_token_ids is not None or request.prefix_id is not None
        ):
            raise SchedulerError(
                f"request {request.request_id!r} carries prefix content (token ids or a "
                "prefix id) for the prefix cache, but blocks are only counted "
                "(CacheConfig.block_ids=False): use block_ids=True to cache prefixes"
            )

    def _check_fits(self, request: Request) -> None:
        total = request.num_prompt_tokens + request.max_output_tokens
        if total > self.max_context_tokens:
            raise RequestTooLongError(
                f"request {request.request_id!r} needs {total} tokens (prompt "
                f"{request.num_prompt_tokens} + max_output_tokens {request.max_output_tokens}) "
                f"but the maximum context is {self.max_context_tokens} tokens"
            )
        if request.num_prefill_tokens > self.max_prompt_tokens:
            raise RequestTooLongError(
                f"request {request.request_id!r} has a {request.num_prefill_tokens}-token prompt; "
                f"the longest prompt this configuration can prefill is {self.max_prompt_tokens} "
                "tokens (KV memory, or a chunk alone exceeding target_batch_time)"
            )

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its KV is freed now, or when its in-flight batch ends."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.in_flight:
            self._abort_pending.add(request_id)
            self._queue.remove(request_id)
        else:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    # ---------------------------------------------------------------- queries
    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._requests) - len(self._running)

    @property
    def num_queued(self) -> int:
        """Requests waiting for a prefill chunk (new, preempted or between chunks)."""
        return len(self._queue)

    @property
    def num_in_flight_batches(self) -> int:
        return len(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # --------------------------------------------------------------- schedule
    def schedule(self, now: float) -> ScheduleOutput:
        """Form the next batch at time ``now`` (seconds, never decreasing)."""
        draft, lane, grants, preempted, _ = self._pack(now)
        return self._emit(draft, now, lane, grants, preempted)

    def _pack(
        self, now: float, *, take: bool = True
    ) -> tuple[Draft, Lane | None, list[BlockGrant], list[str], list[str]]:
        """The next batch's draft at ``now``: ``(draft, lane, block grants,
        preempted, chosen)``; ``chosen`` as :meth:`_pack_prefills` returns it with
        ``take`` (empty when the scan took its prompts out of the queue)."""
        if not -_INF < now < _INF or now < self._clock:  # NaN fails: it would stop checks
            if now < self._clock:
                raise SchedulerError(f"time went backwards: now={now} < previous {self._clock}")
            raise SchedulerError(f"now must be a finite number of seconds, got {now!r}")
        self._clock = now
        if self.prefill_times.refresh(now):
            self._reprice()
        draft = self._new_draft()
        lane, grants, preempted = self._pack_decodes(draft, now)
        chosen = self._pack_prefills(draft, now, take=take)
        return draft, lane, grants, preempted, chosen

    def schedule_plain(
        self, now: float
    ) -> tuple[int, float, int, list[tuple[str, int, bool]], int]:
        """:meth:`schedule` for a caller that reads only the batch's shape (a
        simulator): ``(batch id, predicted seconds, decodes, prefill chunks as
        (request id, tokens, samples) in policy order, preemptions)``. The
        same decisions and state afterwards; no :class:`ScheduleOutput` is
        built (an empty batch has no decodes and no chunks).
        """
        draft, lane, _, preempted, _ = self._pack(now)
        return self._plain(draft, lane, now, preempted)

    def _plain(
        self, draft: Draft, lane: Lane | None, now: float, preempted: list[str]
    ) -> tuple[int, float, int, list[tuple[str, int, bool]], int]:
        """Issue ``draft`` (with ``lane``'s decodes) as :meth:`schedule_plain` returns it."""
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        decodes = 0 if lane is None else len(lane.members)
        self._lanes.issue_unspelled(lane, batch_id)
        chunks = []
        entries = []
        pop_new_blocks = self.memory.pop_new_blocks
        for r, n in draft.entries:  # _emit, less the chunks
            pop_new_blocks(r.request_id)
            start, samples = self._advance(r, n, now)
            chunks.append((r.request_id, n, samples))
            entries.append((r, start, n, samples))
        if entries or lane is not None:
            self._in_flight[batch_id] = _InFlight(entries, lane)
        return batch_id, draft.cost.time, decodes, chunks, len(preempted)

    def _advance(self, r: Request, n: int, now: float) -> tuple[int, bool]:
        """Count ``n`` more tokens of ``r`` as scheduled at ``now``: ``(the chunk's
        start, whether it samples)``; a prefill that ends here starts its TPOT SLO."""
        start = r.num_scheduled_tokens
        r.num_scheduled_tokens = start + n
        if start + n >= r.num_prefill_tokens and r.tpot_slo is not None:
            self._tpot[r.request_id] = r.tpot_slo
        if r.first_scheduled_time is None:
            r.first_scheduled_time = now
        return start, start + n == r.num_prompt_tokens + len(r.output_token_ids)

    def _cost_template(self) -> BatchCost:
        """An empty batch as drafts start: priced by the cost model, on every KVP
        group, one-group probes by ``_draft_price``."""
        return BatchCost(self.cost_model, self.layout.kvp, price=self._draft_price)

    def _new_draft(self) -> Draft:
        """An empty batch priced by the cost model, with this step's time budget."""
        return Draft(self._empty_cost.empty(), self._target_time())

    def _joined_draft(
        self,
        request: Request,
        groups: tuple[int, ...],
        n: int,
        time: float,
        base: list[float] | None,
        decodes: int,
        is_long: bool,
    ) -> Draft:
        """The draft :meth:`turn_run`'s scan turn starts from, built at once: a
        lane of ``decodes`` whose one-group totals are ``base`` (None: no lane),
        then ``n`` tokens of ``request`` (its first shard's tail, on ``groups``)
        joined, ``time`` their batch's price (the model's ``chunk_price``, as
        its search found it). The state that :meth:`_new_draft`, the seed of
        the lane (``seed_priced``, ``set_decodes``), ``note_tail`` of the chunk
        at ``time`` and :meth:`_join` leave."""
        start = request.num_scheduled_tokens
        assert start < self.group_limit, "the first shard's tail"
        # (one group: turn_run's runs need it) the lane and the chunk seeded at once
        cost = self._empty_cost.tail_batch(base, (groups[0], n, start, True), time)
        return Draft(
            cost,
            self._target_time(),
            entries=[(request, n)],
            num_decodes=decodes,
            long_groups={groups[0]} if is_long else set(),
            groups={request.request_id: groups},
            num_tokens=decodes + n,
            num_prefills=1,
        )

    def _target_time(self) -> float:
        target = self.config.target_batch_time
        if self._tpot:
            target = min(target, min(self._tpot.values()))
        return target

    def _pack_decodes(
        self, draft: Draft, now: float
    ) -> tuple[Lane | None, list[BlockGrant], list[str]]:
        """Put every ready decode in the draft; ``(lane, block grants, preempted)``.

        Only decodes crossing a block boundary now touch the KV manager; one
        whose blocks run out preempts (the worst first) as before.
        """
        lanes = self._lanes
        if self._async:
            # every running decode takes a place in the batch whether or not it
            # goes now (as in one gathered lane without async): prefills must not
            # fill the places of decodes held back for a batch in flight
            draft.held_decodes = len(lanes) + sum(
                1 for b in self._in_flight.values() for e in b.entries if e[3]
            )  # and those whose sampling chunk is in flight (they join a lane at its end)
            if any(ln.issued != ln.computed for ln in lanes.ready):
                return self._pack_ahead(draft)
        lane = lanes.gather()
        if lane is None:
            return None, [], []
        cap = self.config.max_batch_requests
        grants: list[BlockGrant] = []
        preempted: list[str] = []
        crossers = lane.cross_at.pop(lane.issued, None)
        if crossers is not None:
            # Those left out by the cap keep their blocks pending: one by one.
            bulk = None if len(lane.members) > cap else lanes.grow_all(lane, crossers)
            if bulk is not None:
                grants = bulk
            else:
                for r in lanes.grow_each(lane, crossers):
                    if r.status is RequestStatus.RUNNING:
                        preempted.extend(self._make_room(r, now))
                grants = lanes.settle(lane, crossers, cap)
                if lane not in lanes.ready:  # every ready decode was preempted
                    return None, grants, preempted
        if len(lane.members) > cap:
            lanes.split(lane, cap)
        self._price_lane(draft, lane)
        return lane, grants, preempted

    def _price_lane(self, draft: Draft, lane: Lane) -> None:
        """Put ``lane``'s decodes in ``draft``: its cost and its decode count."""
        lanes = self._lanes
        if lanes.exact:
            draft.cost.seed(lanes.totals(lane))
        else:
            draft.cost.add(lanes.works(lane))
        draft.set_decodes(len(lane.members))

    # ------------------------------------------------------ decodes issued ahead
    def _pack_ahead(self, draft: Draft) -> tuple[Lane | None, list[BlockGrant], list[str]]:
        """``async_decodes``: a ready lane has a batch in flight (cleared stage 0).

        If it is the only ready lane and may go one ahead
        (:meth:`_may_issue_ahead`), its members' next decodes join the draft
        (their token ids are ``PENDING_TOKEN``). Otherwise no decode is issued
        now: lanes with and without a batch in flight cannot merge (a lane's
        counters move all its members at once), so the others wait until the
        batch in flight ends and every ready lane has none. A member crossing
        a block boundary takes its block in bulk or the lane waits (no
        preemption: every member is in flight, none can be a victim).

        Members that reach ``max_output_tokens`` when the batch in flight ends
        are not issued ahead: they leave the lane first, their decode in that
        batch becoming one of its prefill-style entries (it ends them there).
        """
        lanes = self._lanes
        ready = lanes.ready
        if len(ready) != 1 or not self._may_issue_ahead(ready[0]):
            return None, [], []
        lane = ready[0]
        finishers = lane.finish_at.get(lane.computed + 1)
        fresh = self._fresh.get(lane) if finishers and self._fresh else None
        if fresh:  # filed as if the batch in flight held them: they finish a step later
            finishers = [m for m in finishers if fresh.get(m.request.request_id) is not m]
        if finishers:
            flying = self._in_flight.get(lane.parents[-1]) if lane.parents else None
            if flying is None or flying.lane is not lane:
                return None, [], []  # not the lane's newest batch: wait for it to end
            for m in list(finishers):
                r = m.request
                lanes.leave(r)  # its cursors become plain fields, the decode still in flight
                flying.entries.append((r, r.num_scheduled_tokens - 1, 1, True))
            if not lane.members:
                return None, [], []  # every member finishes (the lane was retired)
        grants: list[BlockGrant] = []
        crossers = lane.cross_at.get(lane.issued)
        if crossers is not None:
            got = lanes.grow_all(lane, crossers)
            if got is None:
                return None, [], []
            del lane.cross_at[lane.issued]
            grants = got
        self._price_lane(draft, lane)
        return lane, grants, []

    def _may_issue_ahead(self, lane: Lane) -> bool:
        """Whether ``lane``'s next decodes may be issued while its newest batch is in
        flight: exactly one is, it cleared stage 0 and the lane fits one batch."""
        return (
            bool(lane.members)
            and lane.issued == lane.computed + 1
            and lane.cleared == lane.issued
            and len(lane.members) <= self.config.max_batch_requests
        )

    def _settle_ahead(self, lane: Lane) -> bool:
        """``async_decodes``, after ``lane``'s batch ended: True when a later batch of it
        is still in flight (issued ahead). Then the lane is ready only if it may go
        one ahead again, and nothing may join it. An emptied lane is retired."""
        lanes = self._lanes
        if not lane.members:
            lanes.retire(lane)
            return True
        if lane.issued == lane.computed:
            return False
        if lane in lanes.ready:
            lanes.ready.remove(lane)
        if self._may_issue_ahead(lane):
            lanes.ready.append(lane)
        return True

    def _make_room(self, request: Request, now: float) -> list[str]:
        """Grow ``request`` by a block, preempting the worst requests if needed."""
        victims: list[str] = []
        while not self.memory.ensure_capacity(request.request_id, request.num_tokens):
            victim = self._pick_victim(request, now)
            self._preempt(victim)
            victims.append(victim.request_id)
            if victim is request:
                break
        return victims

    def _pick_victim(self, needy: Request, now: float) -> Request:
        groups = self.memory.groups_of(needy.request_id)
        shard_full = needy.num_tokens > len(groups) * self.group_limit
        holders = None if shard_full else self.memory.holders(groups[-1])
        candidates = [
            r
            for r in self._running.values()
            if not r.in_flight and (holders is None or r.request_id in holders)
        ]
        # a request grown past what memory admits with the watermark comes back only
        # without it, once its groups are nearly empty: another victim if there is one
        limit = self._max_admit
        able = [r for r in candidates if r.num_tokens <= limit]
        return max(able or candidates, key=lambda r: (self.policy.key(r, now), r.arrival_time))

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the KV, keep the deadline, prefill again."""
        rid = request.request_id
        if rid in self._lanes:
            self._lanes.leave(request)
        self._tpot.pop(rid, None)
        del self._seq_of[rid]
        if self._caching:
            self._register(request)  # what it computed stays cached: recompute may hit it
        self.memory.free(rid)
        del self._running[rid]
        request.num_prefill_tokens = request.num_tokens
        request.num_scheduled_tokens = request.num_stage0_tokens = request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.total_work = request.remaining_work = self.prefill_times.remaining_time(
            request.num_prefill_tokens, 0
        )
        self._queue.push(request)

    def _pack_prefills(
        self,
        draft: Draft,
        now: float,
        *,
        take: bool = True,
        joined: Request | None = None,
    ) -> list[str]:
        """The scan: queued prompts' chunks into ``draft``, in policy order. The
        chosen leave the queue (:meth:`_PrefillQueue.take`), or with ``take``
        False stay in it and their ids are returned (the caller takes them, or
        turns them: :meth:`scan_turn`, :meth:`turn_run`); else ``[]``.

        ``joined``: the queue's first prompt at ``now``, whose chunk the caller
        already put in ``draft`` (decodes only before it) as the scan's
        :meth:`_try_prefill` would have (sized, its hint set, :meth:`_join`):
        the scan goes on from there.
        """
        if not self._queue:
            return []
        cfg = self.config
        chosen: list[Request] = []
        skips = 0
        grid, max_skips = cfg.token_grid, cfg.max_consecutive_skips
        entries = draft.entries
        max_entries = cfg.max_batch_requests - max(draft.num_decodes, draft.held_decodes)
        # With adaptive chunking a long prompt cannot join once every KVP
        # group runs a long prefill in this batch (see ChunkSizer.adaptive).
        long_min = cfg.long_prefill_threshold if self._adaptive else None
        long_groups, kvp = draft.long_groups, self.layout.kvp
        spent = None  # _budget_spent(draft), evaluated again only after the draft changes
        first = True
        queue, checked = self._queue, None
        seen = 0  # candidates met that are not long prefills
        visited: list[str] = []
        cursor: ScanCursor | None = None  # the walk, once long prompts are passed over
        if joined is None:
            candidates = walk = queue.iter_sorted(now)
        else:  # the first candidate's steps, its chunk joined
            # (the walk starts at its first step: the scan may not walk at all)
            candidates = walk = _walk(queue, now)
            r = joined
            visited.append(r.request_id)
            first = False
            if long_min is not None and r.num_prefill_tokens < long_min:
                seen += 1
            chosen.append(r)
            if long_min is None or len(long_groups) < kvp:
                next(walk)  # (r: the walk goes on from the second candidate)
            elif seen == queue.num_not_long:
                # the stops below, after a first chunk (the caller found
                # _shorts_out_of_reach(r, now) False: the other one is not taken)
                candidates = iter(())
            else:
                # the second visit's first steps, whatever its candidate: the cap, the budget
                spent = self._budget_spent(draft) if len(entries) < max_entries else True
                cursor, skips = self._second_visit(draft, walk, now, spent, max_skips)
                if skips < 0:
                    candidates = iter(())
                    skips = 0
                elif cursor is not None and cursor.passed:
                    candidates = cursor
                else:
                    next(walk)  # (r: the walk visits the second candidate)
        while (r := next(candidates, _END)) is not _END:
            if r is None:  # a long prompt passed over to here, blocked (see below)
                assert cursor is not None
                if len(entries) >= max_entries:
                    break
                if spent is None:
                    spent = self._budget_spent(draft)
                if spent:
                    break
                if draft.fits_somewhere < grid:
                    r = cursor.resolve()  # its size may lower the floor: its visit, below
                else:  # the visit below would only count its skip
                    skips += 1
                    if skips >= max_skips:
                        break
                    skips = self._pass_blocked(cursor, skips, seen)
                    if skips < 0:
                        break
                    continue
            visited.append(r.request_id)
            if len(entries) >= max_entries:
                break
            if long_min is not None and r.num_prefill_tokens < long_min:
                seen += 1
            if first:  # the floor probes only pay off once a candidate has been passed over
                first = False
                if self._adaptive and draft.cost.time >= draft.target:
                    break
            elif spent is None:
                spent = self._budget_spent(draft)
            if spent:
                break
            remaining = r.num_prefill_tokens - r.num_scheduled_tokens
            smallest = grid if grid < remaining else remaining
            floor = draft.floor
            if floor is None or smallest < floor:
                checked = None  # visited: the stop below is checked again
                blocked = (
                    long_min is not None
                    and r.num_prefill_tokens >= long_min
                    and len(long_groups) >= kvp
                )
                if not blocked and self._try_prefill(r, draft, now):
                    chosen.append(r)
                    skips = 0
                    spent = None
                    if long_min is not None and len(long_groups) >= kvp:
                        if seen == queue.num_not_long:
                            break  # every candidate left is a long prefill: blocked
                        if len(visited) == 1 and self._shorts_out_of_reach(r, now):
                            # the first candidate joined, and so many long prefills
                            # surely come before every other one that the scan
                            # meets only them, blocked, before its skip limit
                            break
                    continue
                if smallest > draft.fits_somewhere:  # else it cannot become the floor
                    self._lower_floor(draft, smallest)
                    spent = None
            skips += 1
            if skips >= max_skips and (entries or draft.num_decodes):
                break  # an empty batch looks on: a request that can run must not wait
            floor = draft.floor
            if floor is not None and floor <= grid and floor != checked:
                # Every candidate left with at least ``floor`` tokens to go is
                # passed over (the floor only falls until a chunk joins, and
                # none can): if no queued request has fewer, the scan is done.
                # The walk meets no candidate twice, so those visited do not
                # count (a chosen one is listed until its take); left out only
                # where the walk on would set ``_walked`` to [] all the same.
                checked = floor
                met = visited if seen and len(visited) > 1 else ()
                if not queue.has_remaining_below(floor, met):
                    break
            if (
                long_min is not None
                and spent is False
                and len(long_groups) >= kvp
                and draft.fits_somewhere >= grid
                and entries
            ):
                if cursor is None:
                    cursor = queue.scan_cursor(walk, now)
                if candidates is walk:  # (until the first pass, the scan walks)
                    cursor.sync(len(visited))
                skips = self._pass_blocked(cursor, skips, seen)
                if skips < 0:
                    break
                candidates = cursor if cursor.passed else walk
        if len(visited) > 1:  # (none when the scan met a prompt that is not long)
            self._walked = [] if seen else visited
        if chosen:
            ids = [r.request_id for r in chosen]
            if not take:
                return ids  # (no forced progress: a chunk joined)
            queue.take(ids)  # the index renews them in place
        if self._adaptive and not entries and not draft.num_decodes and not self._in_flight:
            self._force_progress(draft, now)
        return []

    def _second_visit(
        self, draft: Draft, walk: Iterator[Request], now: float, spent: bool, max_skips: int
    ) -> tuple[ScanCursor | None, int]:
        """A joined scan's second candidate's visit, told without the walk
        where the keys tell it: ``(cursor, skips)``, skips -1 when the visit
        ends the scan. The first candidate, the queue's first prompt at
        ``now`` (``walk``'s first place, not yet walked), is long, its chunk
        joined, and every KVP group holds a long prefill, so each other long
        prompt is blocked; a short prompt is queued. ``spent``: True where
        the draft is at its cap, else :meth:`_budget_spent` (the visit's
        first steps, after its cap check, whatever the candidate).

        - ``spent``: the visit ends the scan, noting the two ids walked (a
          long second) or none (a short one) as ``_walked``. With more than
          two skips allowed either makes :meth:`_shorts_out_of_reach` answer
          False, as ``[]`` does: ``_walked`` is set to ``[]``, no walk.
        - Where a grid chunk fits somewhere (the floor cannot fall) and the
          places of the short prompts are told
          (:meth:`ScanCursor.longs_ahead`), with ``k < max_skips`` long
          prompts before the first of them: the visit of each only counts a
          skip. At the second candidate's, :meth:`_pass_blocked` passes over
          the others (``k - 1`` of them; with ``k`` 1 the walk meets the
          short prompt next, with ``k`` 0 it is the second). So: a cursor
          past them, ``passed`` (the scan iterates it, the walk not taken),
          and ``k`` skips.
        - Otherwise the walk visits the second candidate (skips 0): the
          cursor whose places were asked, if any, not passed.
        """
        # the cursor reads the index's places: no take may be pending (turn_run's
        # queue.first applies them at each turn, and a run takes none)
        assert not self._queue._out, "a joined scan with takes pending"
        if max_skips < 3:
            return None, 0
        if spent:
            self._walked = []
            return None, -1
        if draft.fits_somewhere < self.config.token_grid:
            return None, 0
        cursor = self._queue.scan_cursor(walk, now)
        cursor.met_first()
        k, short = cursor.longs_ahead()
        if not short or k >= max_skips:
            return cursor, 0
        cursor.pass_over(k)
        return cursor, k

    def _pass_blocked(self, cursor: ScanCursor, skips: int, seen: int) -> int:
        """The scan's skip count after passing over the long prompts next in
        ``cursor`` in one step, or -1 when it would stop among them; the
        caller makes sure that every KVP group holds a long prefill (each long
        prompt is blocked), that a chunk joined, and that the budget is not
        spent and a grid chunk fits somewhere (``draft.fits_somewhere``, so no
        prompt's smallest chunk can lower the floor). Then the visit of each
        of them only counts a skip (and notes its id, which only matters if
        the scan meets no short prompt), so passing over ``k`` of them adds
        ``k`` skips, or ends the scan at the skip limit. Done only where the
        scan then meets a short prompt, or has met one (``seen``)."""
        k, short = cursor.longs_ahead()
        if not k or not (seen or (short and skips + k < self.config.max_consecutive_skips)):
            return skips  # (the walk goes on: their ids may matter)
        if skips + k >= self.config.max_consecutive_skips:
            return -1
        cursor.pass_over(k)
        return skips + k

    def _force_progress(self, draft: Draft, now: float) -> None:
        """Nothing runs and no chunk fits the budget (a learning cost model that met
        a slow device can price every chunk over T): the first queued request that
        KV memory allows takes one grid chunk anyway, so the server never idles
        with work it could do. A static model never gets here for an admitted
        prompt (its chunks are checked against T alone at admission)."""
        for r in self._queue.iter_sorted(now):
            if self._try_prefill(r, draft, now, force=True):
                self._queue.remove(r.request_id)
                return

    def _budget_spent(self, draft: Draft) -> bool:
        """True when no queued request's prefill chunk can join the draft."""
        if not self._adaptive:
            size = self.config.chunk_size
            return size is not None and size > 0 and draft.num_tokens >= size
        if draft.cost.time >= draft.target:
            return True
        if draft.floor is None and draft.fits_somewhere < 1:
            # One token at KV 0 bounds any chunk's cost. A grid chunk is probed
            # first: when it fits, so does every candidate's smallest chunk.
            grid = self.config.token_grid
            self._lower_floor(draft, grid)
            if draft.floor is not None:
                if not self._queue.has_remaining_below(min(draft.floor, grid)):
                    return True  # every candidate's smallest chunk is at least the floor
                self._lower_floor(draft, 1)
        return draft.floor == 1

    def _lower_floor(self, draft: Draft, tokens: int) -> None:
        """Record ``tokens`` as the draft's floor if such a chunk fits on no group."""
        if not self._adaptive or (draft.floor is not None and draft.floor <= tokens):
            return
        if tokens <= draft.fits_somewhere:
            return  # a chunk at least this big fits on some group
        cost, target, kvp = draft.cost, draft.target, self.layout.kvp
        if kvp == 1:  # told by the price's bounds, unpriced, where they tell
            fits = cost.fits_tail(tokens, target)
            if fits is not None:
                if fits:
                    draft.fits_somewhere = tokens
                else:
                    draft.floor = tokens
                return
        time_with_tail = cost.time_with_tail
        if (
            time_with_tail(0, tokens, 0) > target
            if kvp == 1
            else all(time_with_tail(g, tokens, 0) > target for g in range(kvp))
        ):
            draft.floor = tokens
        else:
            draft.fits_somewhere = tokens

    def _try_prefill(
        self, request: Request, draft: Draft, now: float, *, force: bool = False
    ) -> bool:
        rid = request.request_id
        admitted = rid in self._running
        cached, hashes = 0, ()
        # a preempted request grown past what the watermark lets memory admit
        # comes back into memory without it (with it, it never would)
        reserve = 0 if request.num_prefill_tokens > self._max_admit else None
        if admitted:
            groups = self.memory.groups_of(rid)
        elif self._caching:
            hashes = self._lookup_hashes(request)
            plan = self.memory.plan_admit_cached(
                request.num_prefill_tokens, hashes, reserve=reserve
            )
            if plan is None:
                return False  # no memory for the rest of the prompt yet
            groups, cached = plan
            # the cached prefix counts as computed: the first chunk starts after it
            self._set_cursors(request, cached)
        else:
            groups = self.memory.plan_admit(request.num_prefill_tokens, reserve=reserve)
        if groups is None:
            return False  # no memory for the whole prompt yet
        if self.config.adaptive:
            n, is_long = self._sizer.adaptive(request, groups, draft, now, force=force)
        else:
            n, is_long = self._sizer.fixed(request, draft), False
        if n == 0:
            if cached:
                self._set_cursors(request, 0)
            return False
        if not admitted:
            if self._caching or len(groups) != 1:
                ok = self.memory.admit(rid, request.num_prefill_tokens, hashes, reserve=reserve)
                assert ok and self.memory.groups_of(rid) == groups, (
                    "admission differs from its plan"
                )
            else:  # the plan stands: nothing changed since plan_admit
                self.memory.admit_one_shard(rid, request.num_prefill_tokens, groups[0])
            if self._caching:
                assert self.memory.cached_tokens(rid) == cached, "cache hit differs from its plan"
                request.num_cached_tokens = cached
                if request.prefix_caching:  # (one that opts out was not looked up)
                    self.prefix_cache_queries += request.num_prefill_tokens
                    self.prefix_cache_hits += cached
            self._running[rid] = request
            self._seq += 1
            self._seq_of[rid] = self._seq
            request.status = RequestStatus.RUNNING
        self._join(draft, request, groups, n, is_long)
        return True

    def _join(
        self, draft: Draft, request: Request, groups: tuple[int, ...], n: int, is_long: bool
    ) -> None:
        """``n`` tokens of ``request`` (on KVP ``groups``; ``is_long``: a long
        prefill, its shard's group held) join ``draft``: :meth:`_try_prefill`'s
        last step, once the chunk is sized."""
        draft.groups[request.request_id] = groups
        start = request.num_scheduled_tokens
        if is_long:
            draft.long_groups.update(groups[: start // self.group_limit + 1])
        draft.add(request, n, chunk_works(groups, start, n, self.group_limit))
        draft.num_prefills += 1

    def _emit(
        self,
        draft: Draft,
        now: float,
        lane: Lane | None,
        grants: list[BlockGrant],
        preempted: list[str],
    ) -> ScheduleOutput:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        decodes = self._lanes.issue(lane, batch_id, grants)
        chunks = []
        entries = []
        limit, pop_new_blocks = self.group_limit, self.memory.pop_new_blocks
        groups_of = draft.groups
        for r, n in draft.entries:
            rid = r.request_id
            start, samples = self._advance(r, n, now)
            groups = groups_of[rid][: start // limit + 1]
            ids = () if r.prompt_token_ids is None else r.token_ids(start, start + n)
            chunks.append(ScheduledChunk(rid, start, n, groups, pop_new_blocks(rid), ids, samples))
            entries.append((r, start, n, samples))
        if entries or lane is not None:
            self._in_flight[batch_id] = _InFlight(entries, lane)
        return ScheduleOutput(
            batch_id,
            now,
            tuple(chunks),
            tuple(preempted),
            draft.cost.time,
            draft.target,
            decodes,
        )

    # ------------------------------------------------------------ decode runs
    def plan_decode_run(self, max_steps: int, budget: float = float("inf")) -> list[float]:
        """Predicted seconds of the next decode-only iterations, if they are certain.

        They are when no prompt waits, no batch is in flight and every running
        request fits in one batch. Returns at most ``max_steps`` times, none
        for an iteration in which a request would finish, be preempted or open
        a KVP shard; an empty list when a run cannot start now. Changes no
        decision (it may regroup the decodes' lanes). With an exact cost model
        it stops early once the times add up to ``budget`` seconds (that last
        one included). See :mod:`medha_sched.decode_run`.
        """
        running = self._running
        if (
            self._queue
            or self._in_flight
            or self._abort_pending
            or not running
            or len(running) > self.config.max_batch_requests
        ):
            return []
        lanes = self._lanes
        lane = lanes.gather()
        assert lane is not None and len(lane.members) == len(running), "a running request idles"
        requests = [m.request for m in lane.members]
        steps = decode_run_limit(requests, self.memory, max_steps)
        if steps == 0:
            return []
        if lanes.exact:
            return plan_lane_run(lanes, lane, self.cost_model, steps, budget)
        kvp = self.layout.kvp
        return plan_decode_run(
            requests,
            self.memory,
            lambda: BatchCost(self.cost_model, kvp),
            self.group_limit,
            steps,
        )

    def commit_decode_run(self, starts: Sequence[float]) -> range:
        """Take the first ``len(starts)`` iterations of the planned run as done.

        ``starts`` are their issue times (non-decreasing). Every running
        request gains one token (id 0) per iteration, exactly as if each had
        been scheduled and had ended. Returns the batch ids they used.
        """
        if not starts:
            return range(0)
        if starts[0] < self._clock:
            raise SchedulerError(f"time went backwards: {starts[0]} < previous {self._clock}")
        lane = self._lanes.gather()
        assert lane is not None
        steps = len(starts)
        wants = [(m.request.request_id, m.request.num_tokens + steps - 1) for m in lane.members]
        failed = self.memory.ensure_capacity_many(wants)
        if failed:  # decode_run_limit checked the room: this is a bug, not a state
            raise AssertionError(f"a decode run ran out of KV memory for {failed}")
        for rid, _ in wants:
            self.memory.pop_new_blocks(rid)
        self._lanes.advance(lane, steps, token_id=0)
        self._clock = starts[-1]
        first = self._next_batch_id
        self._next_batch_id += steps
        return range(first, self._next_batch_id)

    def plan_lane_cycle(self, max_steps: int, budget: float = float("inf")) -> LaneCycle | None:
        """The lanes' next turns while decodes are in flight, if they are certain.

        They are when no prompt waits, nothing is being aborted, every batch
        in flight is decode-only and each lane fits in one batch; None
        otherwise (or when some lane cannot take a turn). Each lane gets at
        most ``max_steps`` times, at most one more than the lane with fewest
        (the turns go round robin: a cycle stops at the first lane out of
        them), and no more once they add up to ``budget`` seconds (that last
        one included). Changes no decision (it may merge the ready lanes, as
        ``schedule`` would). Exact cost models only (see
        :mod:`medha_sched.decode_set`).
        """
        flying = self._in_flight
        if self._queue or self._abort_pending or not flying or not self._lanes.exact:
            return None
        lanes = [None]
        for batch in flying.values():
            if batch.entries or batch.lane is None:
                return None
            lanes.append(batch.lane)
        ready = self._lanes.gather()
        if ready is None:
            return None
        lanes[0] = ready
        cap = self.config.max_batch_requests
        sizes = [len(lane.members) for lane in lanes]
        if max(sizes) > cap or sum(sizes) != len(self._running):
            return None
        counts = []
        for i, lane in enumerate(lanes):
            left = min(
                m.request.max_output_tokens - m.request.num_output_tokens for m in lane.members
            )
            # a lane in flight has a token coming that the cycle's turns may not finish with
            counts.append(min(max_steps, left if i == 0 else left - 1))
        if min(counts) < 1:
            return None
        steps = max(counts)
        while not kv_fits(
            self.memory,
            [
                (m.request, m.request.num_scheduled_tokens + min(c, steps))
                for lane, c in zip(lanes, counts, strict=True)
                for m in lane.members
            ],
        ):
            steps //= 2
            if steps == 0:
                return None
        counts = _round_robin_counts([min(c, steps) for c in counts])
        model = self.cost_model
        times = [
            plan_lane_run(self._lanes, lane, model, c, budget)
            for lane, c in zip(lanes, counts, strict=True)
        ]  # type: ignore[arg-type]
        return LaneCycle(lanes, list(flying), sizes, times)  # type: ignore[arg-type]

    def commit_lane_cycle(self, plan: LaneCycle, n: int, last_start: float) -> range:
        """Take the first ``n`` turns of ``plan`` as issued (``n >= len(plan.lanes)``).

        The batches in flight when it was planned end, every turn but each
        lane's last one is issued and ends, and each lane's last turn is in
        flight (as ``schedule`` would have left it), the last issued at
        ``last_start``. Every decode's token is 0. Returns the batch ids used.
        """
        k = len(plan.lanes)
        if n < k:
            raise ValueError(f"a lane cycle commits at least one turn per lane ({k}), got {n}")
        if last_start < self._clock:
            raise SchedulerError(f"time went backwards: {last_start} < previous {self._clock}")
        lanes, memory = self._lanes, self.memory
        for bid, lane in zip(plan.in_flight, plan.lanes[1:], strict=True):
            batch = self._in_flight.pop(bid)
            if not batch.stage0_cleared:
                lanes.cleared(lane)
            if lanes.returned(lane, ZERO_TOKENS, set()):
                raise AssertionError("a lane cycle finished a request")
        for i, lane in enumerate(plan.lanes):
            bulk = (n - i + k - 1) // k - 1  # turns of lane i that also end
            if bulk:
                wants = [
                    (m.request.request_id, m.request.num_tokens + bulk - 1) for m in lane.members
                ]
                failed = memory.ensure_capacity_many(wants)
                if failed:  # plan_lane_cycle checked the room: a bug, not a state
                    raise AssertionError(f"a lane cycle ran out of KV memory for {failed}")
                for rid, _ in wants:
                    memory.pop_new_blocks(rid)
                lanes.advance(lane, bulk, token_id=0)
        first = self._next_batch_id
        for i in range(n - k, n):
            lane = plan.lanes[i % k]
            crossers = lane.cross_at.pop(lane.issued, None)
            grants = [] if crossers is None else lanes.grow_all(lane, crossers)
            if grants is None:
                raise AssertionError("a lane cycle's last turn could not grow its KV")
            lanes.issue_unspelled(lane, first + i)
            self._in_flight[first + i] = _InFlight([], lane)
        self._next_batch_id = first + n
        self._clock = last_start
        return range(first, first + n)

    # ----------------------------------------------------------- lone prefills
    def lone_prefill(self) -> Request | None:
        """The request whose prefill chunks alone make the next batches, if any.

        That is when, with adaptive chunking, it is the only running request,
        it waits for its next chunk, nobody else waits, nothing decodes and
        every batch in flight holds only its chunks and has cleared stage 0.
        Then each next batch is its next chunk, sized by ``schedule``'s rule;
        :meth:`lone_prefill_turn` and :meth:`commit_lone_prefill` take them
        without forming whole batches.
        """
        if (
            not self._adaptive
            or len(self._queue) != 1
            or len(self._running) != 1
            or len(self._lanes)
            or self._lanes.ready
            or self._abort_pending
        ):
            return None
        request = next(iter(self._running.values()))
        if request.request_id not in self._queue:
            return None
        for batch in self._in_flight.values():
            if batch.lane is not None or not batch.stage0_cleared:
                return None
            for r, _, _, _ in batch.entries:
                if r is not request:
                    return None
        return request

    def _size_turn(
        self, request: Request, now: float, totals: list[list[int] | None] | None, decodes: int
    ) -> tuple[tuple[int, ...], int, int, int | None, float] | None:
        """A turn's chunk of ``request`` beside a lane's ``decodes`` (their summed
        features ``totals`` per group; None: no lane), sized as ``schedule`` would:
        ``(groups, start, tokens, the hint before it, predicted seconds)``, or None
        when no chunk fits or it would end the prefill. Leaves the sizer's hint
        at the chunk, as ``adaptive`` does; nothing else changes."""
        rid = request.request_id
        agg = self._one_group
        start = request.num_scheduled_tokens
        if agg is not None and start < self.group_limit:
            # one KVP group, a chunk in the first shard: the draft's sums without the draft
            base = None if totals is None else totals[0]
            base_time = 0.0 if base is None else agg.group_time(base)  # BatchCost.seed's
            target = self._target_time()
            if base_time >= target:
                return None
            sizer = self._sizer
            hint = sizer.hint(rid)
            n, time = sizer.adaptive_alone(
                request,
                agg.group_time,
                agg.features,
                base,
                base_time,
                target,
                now,
                agg.chunk_time_fn,
            )
            if n == 0 or start + n >= request.num_prefill_tokens:
                return None
            sizer.set_hint(rid, n)  # as adaptive() leaves it
            return self.memory.groups_of(rid), start, n, hint, time
        draft = self._new_draft()
        if totals is not None:
            draft.cost.seed(totals)
            draft.set_decodes(decodes)
        if draft.cost.time >= draft.target:
            return None
        sized = self._turn_chunk(request, draft, now)
        if sized is None:
            return None
        groups, start, n, hint = sized
        draft.add(request, n, chunk_works(groups, start, n, self.group_limit))
        return groups, start, n, hint, draft.cost.time

    def lone_prefill_turn(
        self, request: Request, now: float, *, cleared: bool
    ) -> tuple[int, float] | None:
        """Issue ``request``'s next chunk at ``now`` as ``schedule`` would size it:
        ``(tokens, predicted seconds)``, or None, changing nothing, when no
        chunk fits or the chunk would end the prefill (those go through
        ``schedule``). ``cleared``: its previous turn's chunk cleared stage 0
        at ``now`` (its prefill work is priced again first, as ``on_stage_end``
        does). Only for the request :meth:`lone_prefill` named, with
        :meth:`commit_lone_prefill` to follow.
        """
        if now < self._clock:
            raise SchedulerError(f"time went backwards: now={now} < previous {self._clock}")
        if cleared:
            self._refresh_work(request)
        rid = request.request_id
        sized = self._size_turn(request, now, None, 0)
        if sized is None:
            return None
        _, start, n, _, time = sized
        self.memory.pop_new_blocks(rid)  # none after the first chunk; as _emit would
        request.num_scheduled_tokens = start + n
        self._clock = now
        return n, time

    def _turn_chunk(
        self, request: Request, draft: Draft, now: float
    ) -> tuple[tuple[int, ...], int, int, int | None] | None:
        """A turn's chunk as ``schedule`` would size it: ``(groups, start, tokens,
        the sizer's previous hint)``, or None (the hint kept) when no chunk fits
        or the chunk would end the prefill (those go through ``schedule``)."""
        rid = request.request_id
        groups = self.memory.groups_of(rid)
        sizer = self._sizer
        hint = sizer.hint(rid)
        n, _ = sizer.adaptive(request, groups, draft, now)
        start = request.num_scheduled_tokens
        if n == 0 or start + n >= request.num_prefill_tokens:
            sizer.set_hint(rid, hint)
            return None
        return groups, start, n, hint

    def commit_lone_prefill(
        self, request: Request, chunks: Sequence[int], cleared: int, ended: int, done: Sequence[int]
    ) -> range:
        """After :meth:`lone_prefill_turn` issued ``chunks`` (in order): the first
        ``cleared`` of them have cleared stage 0 and the first ``ended`` have
        left the pipeline; of the batches in flight before, those in ``done``
        have too. Leaves the batches still in flight as ``schedule`` would
        have; returns the batch ids the turns used.
        """
        if not chunks or not ended <= cleared <= len(chunks) - 1:
            raise ValueError(
                f"bad lone-prefill commit: {len(chunks)} chunks, {cleared} cleared, {ended} ended"
            )
        for bid in done:
            self.on_batch_end(bid, _NO_TOKENS)
        self.end_prefill_turns(request, len(chunks), queued=False)
        if ended:
            request.num_computed_tokens += sum(chunks[:ended])
            if self._caching:
                self._register(request)
        request.num_stage0_tokens += sum(chunks[:cleared])
        first = self._next_batch_id
        start = request.num_scheduled_tokens - sum(chunks)
        for i, n in enumerate(chunks):
            if i >= ended:
                self._in_flight[first + i] = _InFlight(
                    [(request, start, n, False)], None, stage0_cleared=i < cleared
                )
            start += n
        self._next_batch_id = first + len(chunks)
        return range(first, first + len(chunks))

    # -------------------------------------------------- prefill beside decodes
    def turns_prefill(self, now: float | None = None) -> Request | None:
        """The request whose prefill chunks, beside the decodes, make the next
        batches, if any: with adaptive chunking and an exact cost model, it is
        the only request waiting, every other running request decodes, and
        every batch in flight holds only its chunks (stage 0 cleared) and
        decodes. Then each next batch, issued when the previous clears stage
        0, is the ready decodes plus its next chunk; :meth:`prefill_turn`,
        :meth:`clear_turn` and :meth:`end_prefill_turns` take them without
        the queue scan or a :class:`ScheduleOutput`.

        Long prompts waiting together (``now`` given; every queued prompt
        long, or the short ones out of the scan's reach by
        :meth:`_shorts_out_of_reach`; the first at ``now`` admitted, every
        batch in flight cleared stage 0): each next batch is the ready
        decodes plus a chunk of the prompt first in the queue at its time.
        Its long chunk holds every KVP group, so the scan stops after it (see
        :meth:`_pack_prefills`); the turns (``prefill_turn(None, ...)``) look
        up only that first prompt, and check the reach again at each turn.
        Returns the first prompt at ``now``.

        Never with ``async_decodes``: the turns do not issue decodes ahead nor
        hold them back as :meth:`schedule` does then.
        """
        queue = self._queue
        if self._async:
            return None
        if not self._adaptive or not self._lanes.exact or not queue or self._abort_pending:
            return None
        if len(queue) > 1:
            if now is None:
                return None
            request = queue.first(now)
            if request is None or request.request_id not in self._running:
                return None  # its first chunk admits it: schedule() decides
            for batch in self._in_flight.values():
                if batch.entries and not batch.stage0_cleared:
                    return None
            if queue.num_not_long and not self._shorts_out_of_reach(request, now):
                return None
            return request
        if len(self._running) != len(self._lanes) + 1:
            return None
        request = queue.only()
        if request.request_id not in self._running or request.request_id in self._lanes:
            return None
        for batch in self._in_flight.values():
            for r, _, _, _ in batch.entries:
                if r is not request or not batch.stage0_cleared:
                    return None
        return request

    def _shorts_out_of_reach(self, first: Request, now: float) -> bool:
        """True when ``first``, the queue's first prompt at ``now`` and long, is
        followed by so many long prompts surely coming before every queued
        prompt that is not long that the scan of :meth:`_pack_prefills`, once
        ``first``'s chunk joins, stops with that chunk alone: the stop it takes
        itself (the same proof, ``_PrefillQueue.ahead_of_not_long`` on ``first``
        and the latest whole scan's candidates, under the same conditions).
        Then a batch of the decodes and a chunk of ``first`` is the batch
        ``schedule`` forms, short prompts queued or not. The two paths may
        answer the proof differently (its margin bounds and ``_walked`` depend
        on the index's history: a turn renews ``first`` in place, a scan takes
        it out and pushes it back), so batches rely on the proof being sound
        wherever it holds, not on equal state: after ``first``'s chunk holds
        every group, the next ``max_consecutive_skips`` candidates it proves
        long are all blocked, and every exit they reach adds nothing.

        The callers (:meth:`turn_run`, :meth:`prefill_turn`; :meth:`turns_prefill`
        to open the turns) take the turn only where ``first``'s chunk holds
        every KVP group (one group: always), so that every other long prompt
        is blocked, as in the scan. False (the scan decides) whenever the
        proof does not hold or is not tried: it reads every queued short
        prompt's key, so with more of them than a few walks' worth (``4 *
        max_consecutive_skips``) it would cost more than the walk it saves.
        With fewer than ``max_consecutive_skips`` ids walked it cannot hold
        (it counts distinct ids among ``first``'s and theirs), so the keys are
        not read.
        """
        cfg = self.config
        queue, walked = self._queue, self._walked
        max_skips = cfg.max_consecutive_skips
        return (
            # more than max_skips ids, or the count (of distinct ids) cannot exceed it
            len(walked) >= max_skips
            and first.num_prefill_tokens >= cfg.long_prefill_threshold
            and queue.num_not_long <= 4 * max_skips
            and queue.ahead_of_not_long([first.request_id, *walked], now) > max_skips
        )

    def prefill_turn(
        self, request: Request | None, now: float
    ) -> tuple[int, int, float, int] | None:
        """Issue the ready decodes and ``request``'s next chunk at ``now`` as
        ``schedule`` would: ``(batch id, tokens, predicted seconds, decodes)``; None,
        changing no decision, when no chunk joins, the chunk would end the
        prefill, or the decodes would need a preemption or a split. The batch
        is in flight as ``schedule`` leaves it (its id is the next one).

        ``request`` None: long prompts wait together (see :meth:`turns_prefill`);
        the chunk is the first queued prompt's, taken out of the queue as the
        scan takes it (:meth:`clear_turn` puts it back). None also when a short
        prompt waits within the scan's reach (:meth:`_shorts_out_of_reach` does
        not hold), that prompt is not admitted, or its chunk leaves a KVP
        group free.
        """
        if now < self._clock:
            raise SchedulerError(f"time went backwards: now={now} < previous {self._clock}")
        queue = self._queue
        shared = request is None
        if shared:
            request = queue.first(now)
            if request is None or request.request_id not in self._running:
                return None
            if queue.num_not_long and not self._shorts_out_of_reach(request, now):
                return None  # a short prompt may be within the scan's reach
        assert request is not None  # given, or the queue's first
        rid = request.request_id
        lanes = self._lanes
        lane = lanes.gather()
        decodes = 0
        crossers = None
        totals = None
        if lane is not None:
            decodes = len(lane.members)
            if decodes >= self.config.max_batch_requests:
                return None  # a split, or no room for a chunk
            crossers = lane.cross_at.get(lane.issued)
            totals = lanes.totals(lane)
        if shared:
            groups = self.memory.groups_of(rid)
            start = request.num_scheduled_tokens
            if len(set(groups[: start // self.group_limit + 1])) < self.layout.kvp:
                return None  # a free KVP group: the scan would go on (checked before sizing)
        sized = self._size_turn(request, now, totals, decodes)
        if sized is None:
            return None
        groups, start, n, hint, time = sized
        if crossers is not None:
            got = lanes.grow_all(lane, crossers)  # type: ignore[arg-type]
            if got is None:  # short of blocks or a new shard: schedule() decides
                self._sizer.set_hint(rid, hint)
                return None
            del lane.cross_at[lane.issued]  # type: ignore[union-attr]
        self.memory.pop_new_blocks(rid)  # none after the first chunk; as _emit would
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        lanes.issue_unspelled(lane, batch_id)
        self._in_flight[batch_id] = _InFlight([(request, start, n, False)], lane)
        request.num_scheduled_tokens = start + n
        if shared:  # out of the queue, as the scan takes it: renewed at clear_turn
            self._turn_out[rid] = None
        self._clock = now
        return batch_id, n, time, decodes

    def scan_turns(self, now: float) -> bool:
        """Whether the batches from ``now`` may go as shared turns (see
        :meth:`turns_prefill`) even where no prompt's turn is taken: prompts wait
        together (more than one queued) and, as for those turns, adaptive
        chunking with an exact cost model, no ``async_decodes``, no abort
        pending and every batch in flight holding prefill chunks cleared stage
        0. Then a turn :meth:`prefill_turn` refuses is the scan's batch,
        :meth:`scan_turn`."""
        if (
            not self.turn_scans
            or self._async
            or not self._adaptive
            or not self._lanes.exact
            or self._abort_pending
            or len(self._queue) < 2
            or now < self._clock
        ):
            return False
        for batch in self._in_flight.values():
            if batch.entries and not batch.stage0_cleared:
                return False
        return True

    def scan_turn(
        self, now: float
    ) -> tuple[int, float, int, list[tuple[str, int, bool]], int, bool]:
        """:meth:`schedule_plain` at ``now`` (the same batch, decisions and state
        but for the queue), its answer and whether the batch went as a turn.

        A turn when the scan's chunks (one or more) all leave their prompts
        unfinished (none samples) and no decode was preempted: the chosen
        prompts then stay in the queue's index, out of it until the batch
        clears stage 0 (:meth:`clear_turn` renews them in place, as the push
        of :meth:`on_stage_end` would put them back; :meth:`end_prefill_turns`
        takes out those whose batch has not cleared, in the order the scan
        chose them). Otherwise the batch is :meth:`schedule_plain`'s in full
        (the scan's choice taken out of the queue) and goes as one: its stage
        0 end is :meth:`on_stage_end`'s. Only where :meth:`scan_turns` holds.
        """
        draft, lane, _, preempted, chosen = self._pack(now, take=False)  # not yet taken
        turn = bool(chosen) and not preempted
        if turn:
            for r, n in draft.entries:
                if r.num_scheduled_tokens + n >= r.num_prefill_tokens:
                    turn = False  # it samples: it joins the decodes at the batch end
                    break
        if turn:
            self._turn_out.update(dict.fromkeys(chosen))  # out at the turn: see clear_turn
        elif chosen:
            self._queue.take(chosen)  # as the scan takes them
        return (*self._plain(draft, lane, now, preempted), turn)

    def turn_run(
        self,
        request: Request | None,
        now: float,
        horizon: float,
        free: list[float],
        ends_before: Sequence[float],
    ) -> TurnRun | None:
        """:meth:`prefill_turn`, the ends of the batches due before each next turn
        and :meth:`clear_turn`, over and over, in one call: the turns from ``now``
        (stage 0 free, every batch in flight cleared it), each issued when the
        one before clears stage 0, until one would clear it at or after
        ``horizon`` (that one is issued and stays in flight, as the per-turn
        path leaves it) or a turn the run does not take comes. ``request``:
        the prefill taking the turns, or None for long prompts waiting
        together (each turn takes the first queued, see :meth:`turns_prefill`).

        ``free``: the pipeline's stage free times (one per stage), updated in
        place as :func:`~medha_sched.sim.pipeline.push_times` does;
        ``ends_before``: when each batch in flight now leaves it, in issue
        order. The run makes the calls into the queue and the KV manager the
        per-turn path makes, in the same order, and keeps every decision,
        batch, time and float. It only takes the common turn: one KVP group
        and an aggregate cost model, the prompt's first shard, at most one
        ready lane, no decode finishing at a batch end it handles, block growth
        by ``grow_all``, every batch in flight before it that has not cleared
        stage 0 without any chunk, and the end of a batch in flight with a
        sampling chunk taken as the horizon (if earlier). Any
        other turn is left to the per-turn path (the run stops before it,
        changing nothing for it); None when no turn was taken.
        Every sampled token is 0 (the simulator's convention).

        Scan turns (``turn_scans``, prompts waiting together): where a short
        prompt may be within the scan's reach of the first queued prompt's
        chunk, the turn is the batch :meth:`_pack_prefills` forms (that chunk
        sized here and joined first, the scan going on from it: most often a
        short prompt's chunk joins too), its chosen prompts renewed in the
        queue when it clears stage 0, as :meth:`scan_turn` takes it. The decodes'
        block growth then comes before the scan (as in :meth:`schedule`), a turn
        whose stage-0 time holds a batch end finishing a decode is issued and
        its stage-0 end left to the events, and a batch with a sampling chunk
        is issued after the turns as ``schedule_plain``'s (``TurnRun.plain``),
        the run stopping there.
        """
        agg = self._one_group
        if agg is None or self._async or self._abort_pending:
            return None
        if request is not None and request._lane is not None:
            return None
        if now < self._clock:
            raise SchedulerError(f"time went backwards: now={now} < previous {self._clock}")
        in_flight = self._in_flight
        if len(ends_before) != len(in_flight):
            raise ValueError(
                f"{len(ends_before)} batch ends given for {len(in_flight)} batches in flight"
            )
        # the batches in flight, oldest first: (end, lane, prefill chunks, id), the
        # chunks as _InFlight's entries (request, start, tokens, samples: False)
        flying: list[tuple[float, Lane | None, list[tuple[Request, int, int, bool]], int]] = []
        uncleared: set[int] = set()  # decode-only batches from before that clear at their end
        for end, (bid, batch) in zip(ends_before, in_flight.items(), strict=True):
            if not batch.stage0_cleared:
                if batch.entries:
                    return None
                uncleared.add(bid)
            entries = []
            for entry in batch.entries:
                if entry[3]:  # it samples
                    # its end (a prompt joining the decodes) is not the run's: the
                    # run stops at it, as at the next event (ends come in issue order)
                    if end < horizon:
                        horizon = end
                    break
                entries.append(entry)
            flying.append((end, batch.lane, entries, bid))
        shared = request is None
        queue = self._queue
        first_queued = queue.first
        not_long = queue._not_long  # the ids of the queued prompts that are not long
        # _PrefillQueue.renew less its flush of the scan's deferred takes: the run
        # takes none (its scans pack with take=False), and first_queued flushes
        # at every turn before any renewal
        # (called as renew(queue, r): a plain function's call, which the interpreter
        # makes inline; a partial's goes through C into a new evaluation loop)
        renew = PrefillQueue.renew
        out_of_reach = self._shorts_out_of_reach
        out = self._turn_out
        running = self._running
        spp = len(free)
        lanes = self._lanes
        ready = lanes.ready
        grow_moved = lanes.grow_moved  # grow_all and the crossers' del, no grants built
        cap = self.config.max_batch_requests
        limit = self.group_limit
        hints = self._sizer._last_chunk
        size = self._sizer.adaptive_alone
        group_time, features, chunk_time = agg.group_time, agg.features, agg.chunk_time_fn
        # ChunkSizer.adaptive_alone's rule, inline when the model prices in one call
        price = self._draft_price  # agg.chunk_price(), looked up once
        # largest_chunk_priced over it (the roofline's own search: fewer probes)
        search = None if price is None else chunk_search(price)
        cfg = self.config
        grid, max_chunk, long_min = cfg.token_grid, cfg.max_chunk_tokens, cfg.long_prefill_threshold
        share = cfg.max_space_share if self.policy.space_sharing else None
        memory = self.memory
        drop_new_blocks = memory.drop_new_blocks  # pop_new_blocks, nothing read
        register = self._offer_blocks if self._caching else None  # (_register's test inline below)
        remaining = self.prefill_times.remaining_time  # _refresh_work's, inline
        cache_aware = cfg.cache_aware_slack
        line_a, line_b = lanes._a, lanes._b  # DecodeLanes.totals' rows, inline (one group)
        six = len(line_a) == 6 and len(line_b) == 6  # the roofline's features, unrolled
        if six:
            a0, a1, a2, a3, a4, a5 = line_a
            b0, b1, b2, b3, b4, b5 = line_b
        # a lane's time as a function of its attended pairs and KV tokens, by its
        # number of decodes, where only those two totals move with the lane step
        times_of = self._decode_times if six and not (b0 or b3 or b4 or b5) else None
        if times_of is not None and self._decode_times_revision != getattr(agg, "revision", 0):
            times_of.clear()  # a learning model moved its coefficients
            self._decode_times_revision = getattr(agg, "revision", 0)
        target = self._target_time()  # no finish and no prefill end inside the run

        # A non-scan turn with a lane prices the lane alone (base_time) only when it
        # must. The roofline's chunk price is group_time of the lane's sums plus the
        # chunk's features, every operation monotone in floats (products by non-
        # negative coefficients, sums, max; chunk_price), so a chunk's time is at
        # least the lane's: a chunk found within the goal (p < goal) proves
        # base_time < goal <= target, and the checks on it cannot stop the turn.
        # The search's answer does not depend on the time it starts its secant
        # from (it returns the largest candidate within the goal: chunk_search),
        # only its probes do. So the time is priced when nothing fits (then the turn
        # stops either way: no state changes before those stops) or p == goal.
        roofline = search is not None and getattr(price, "search", None) is search
        lazy = self._lane_time_late and roofline
        first = self._next_batch_id
        before = len(flying)
        starts: list[float] = []
        chunks: list[int] = []
        prefills: list[int] = []
        times: list[float] = []
        decs: list[int] = []
        ends: list[float] = []
        pack, join = self._pack_prefills, self._join
        # refresh(s) rebuilds only once the model's revision moved from the
        # table's; nothing in the run moves it (no call here observes a time),
        # so with them equal now every turn's refresh answers False
        refresh = None if self.prefill_times.current() else self.prefill_times.refresh
        new_draft = self._new_draft
        plain: tuple[Draft, Lane | None, list[str]] | None = None
        turn_scans = self.turn_scans
        head = 0  # the oldest batch in flight in ``flying``
        ended = 0
        # lane -> its batch ends in the run: each member's tokens (0s), appended
        # after the loop (no member joins or leaves a lane inside the run)
        sampled: dict[Lane, int] = {}
        # prompts whose turn went here: their groups were checked and their new
        # blocks dropped (a prefill's blocks are all admitted with its first
        # chunk, and no call in the run takes any for it after), so neither the
        # check nor the drop can change anything at their later turns
        clean: set[str] = set()
        s = now
        cleared = True
        r = request
        while True:
            if len(ready) > 1:
                break  # schedule() merges the ready lanes: the per-turn path does
            scan = False
            if shared:
                if refresh is not None and refresh(s):  # _pack's first step, before the queue
                    self._reprice()
                r = first_queued(s)  # as prefill_turn(None, s) looks it up
                if r is None or r.request_id not in running or r._lane is not None:
                    break
                # a short prompt may be within the scan's reach: the scan decides
                # (queue.num_not_long: first_queued flushed the deferred takes)
                scan = bool(not_long) and not out_of_reach(r, s)
                if scan and not turn_scans:
                    break  # schedule() forms it
            assert r is not None
            rid = r.request_id
            start = r._scheduled
            if start >= limit:
                break
            # one KVP group (start < limit); a prompt that passed keeps its groups
            if shared and rid not in clean and not memory.groups_of(rid):
                break
            lane = ready[0] if ready else None
            unpriced = False
            if lane is None:
                decodes, crossers, base, base_time = 0, None, None, 0.0
            else:
                decodes = len(lane.members)
                if decodes >= cap:
                    break
                crossers = lane.cross_at.get(lane.issued)
                if lane.n_works[0]:  # DecodeLanes.totals(lane)[0], the same integers
                    nt = lane.n_tail[0]
                    kv = lane.kv_sum[0] + nt * lane.issued
                    const = lane.const[0]
                    if const is None and six:  # _lane_sums, unrolled
                        base = [
                            nt * a0 + kv * b0,
                            nt * a1 + kv * b1,
                            nt * a2 + kv * b2,
                            nt * a3 + kv * b3,
                            nt * a4 + kv * b4,
                            nt * a5 + kv * b5,
                        ]
                    else:
                        base = _lane_sums(nt, kv, line_a, line_b, const)
                else:
                    base = None
                if base is None:
                    base_time = 0.0
                elif lazy and not scan:
                    base_time = 0.0  # not priced yet: after the search, if it must be
                    unpriced = True
                else:
                    base_time = self._lane_time(base, nt, const, times_of)
            if base_time >= target:
                break
            if scan and crossers is not None:  # _pack_decodes grows them before the scan
                if not grow_moved(lane, crossers):  # type: ignore[arg-type]
                    break  # short of blocks: schedule() decides
                crossers = None
            total = r.num_prefill_tokens
            if price is None:
                n, p = size(r, group_time, features, base, base_time, target, s, chunk_time)
            else:
                goal = target
                if share is not None and total >= long_min:
                    # min(share, max(0.0, relative_slack(r, s))), inline: the same floats
                    w = r.total_work
                    if w < 1e-12:  # max(w, 1e-12): w itself when equal (or NaN)
                        w = 1e-12
                    rho = (r.deadline - s - r.remaining_work) / w
                    if not rho > 0.0:
                        rho = 0.0
                    if not rho < share:
                        rho = share
                    goal *= 1.0 - rho
                if base_time >= goal:
                    break
                room = total - start  # ChunkSizer.room()
                if max_chunk < room:
                    room = max_chunk
                if limit - start % limit < room:
                    room = limit - start % limit
                # (an unpriced lane's search starts its secant from 0.0 seconds)
                n, p = search(room, grid, base, start, goal, base_time, hints.get(rid, 0))
                if unpriced and n and not p < goal:  # p == goal: the lane's may be the goal
                    base_time = self._lane_time(base, nt, const, times_of)  # type: ignore[arg-type]
                    if base_time >= goal:
                        break
            if n == 0 or start + n >= total:
                break
            if scan:  # the first prompt's chunk joins as in _try_prefill; the scan goes on
                hints[rid] = n  # as ChunkSizer.adaptive leaves it
                groups = memory.groups_of(rid)
                if price is not None:  # the search priced the chunk: the draft at once
                    draft = self._joined_draft(r, groups, n, p, base, decodes, total >= long_min)
                else:
                    draft = new_draft()
                    if lane is not None:  # _price_lane's seed, of the sums and time found above
                        draft.cost.seed_priced(base, base_time)
                        draft.set_decodes(decodes)
                    join(draft, r, groups, n, total >= long_min)
                chosen = pack(draft, s, take=False, joined=r)
                taken = [(x, x._scheduled, k, False) for x, k in draft.entries]
                for x, st, k, _ in taken:
                    if st + k >= x.num_prefill_tokens:
                        # a chunk samples (its prompt joins the decodes at the batch
                        # end): the batch goes as schedule_plain's, after the turns
                        plain = (draft, lane, chosen)
                        break
                if plain is not None:
                    break
                p = draft.cost.time
            else:
                taken = None  # the prompt's chunk alone
            stage = p / spp
            # push_times' answer (sim.pipeline), on a copy of the stages
            x = free[0]
            t = f = (s if s > x else x) + stage
            if spp == 2:  # the loop below, unrolled for the common depth
                x = free[1]
                t = (f if f > x else x) + stage
                moved: Sequence[float] = (f, t)
            else:
                stages = [f]
                for k in range(1, spp):
                    x = free[k]
                    t = (t if t > x else x) + stage
                    stages.append(t)
                moved = stages
            finishes = False
            if f < horizon:  # the batches ending by f end in the run: none may finish a decode
                for i in range(head, len(flying)):
                    end_i, lane_i, _, _ = flying[i]
                    if end_i > f:
                        break
                    if lane_i is not None and lane_i.computed + 1 in lane_i.finish_at:
                        finishes = True
                        break
                if finishes and not scan:
                    break  # the per-turn path takes it
            if crossers is not None and not grow_moved(lane, crossers):  # type: ignore[arg-type]
                break  # short of blocks: schedule() decides
            # the turn goes: prefill_turn's commit (schedule_plain's for the scan's
            # batch, whose chunks the scan sized)
            bid = self._next_batch_id
            self._next_batch_id = bid + 1
            lanes.issue_unspelled(lane, bid)
            if taken is None:
                hints[rid] = n
                if rid not in clean:
                    drop_new_blocks(rid)
                    clean.add(rid)
                r._scheduled = start + n
                chunks.append(n)
                prefills.append(1)
                flying.append((t, lane, [(r, start, n, False)], bid))
            else:
                tokens = 0
                for x, st, k, _ in taken:
                    drop_new_blocks(x.request_id)
                    x._scheduled = st + k
                    if x.first_scheduled_time is None:  # admitted by the scan (_advance's)
                        x.first_scheduled_time = s
                    tokens += k
                chunks.append(tokens)
                prefills.append(len(taken))
                flying.append((t, lane, taken, bid))
            self._clock = s
            free[:] = moved
            starts.append(s)
            times.append(p)
            decs.append(decodes)
            ends.append(t)
            if finishes or not f < horizon:
                # its stage-0 end is an event (a scan's turn whose stage-0 time
                # holds a batch end finishing a decode goes on the events too)
                cleared = False
                if shared:  # its prompts left the queue at the turn (clear_turn puts them back)
                    if taken is None:
                        out[rid] = None
                    else:
                        for x, _, _, _ in taken:
                            out[x.request_id] = None
                break
            # the batch ends due by f, in issue order (on_batch_end's work)
            while head < len(flying) and flying[head][0] <= f:
                _, lane_e, entries, bid_e = flying[head]
                head += 1
                if bid_e < first:
                    del in_flight[bid_e]
                    ended += 1
                    if uncleared and bid_e in uncleared:
                        lane_e.cleared += 1  # type: ignore[union-attr]  # on_stage_end's
                if lane_e is not None:
                    lane_e.computed += 1
                    sampled[lane_e] = sampled.get(lane_e, 0) + 1
                    ready.append(lane_e)
                for r_e, _, n_e, _ in entries:
                    r_e._computed += n_e  # num_computed_tokens += n_e: the lane's part cancels
                    if (
                        register is not None
                        # _register's own first test, inline: most prompts have no
                        # block it could hash, and then it returns at once
                        and (
                            r_e.block_hashes
                            or r_e.prompt_token_ids is not None
                            or r_e.prefix_id is not None
                        )
                        and r_e.request_id in running
                    ):
                        register(r_e)
            # the turn clears stage 0 (clear_turn's work)
            if lane is not None:
                lane.cleared += 1
            if taken is None:
                r._stage0 += n
                done = r._scheduled if cache_aware else r._scheduled - r.num_cached_tokens
                r.remaining_work = remaining(r.num_prefill_tokens, done)
                if shared:  # (out of the queue from the turn to here, as prefill_turn
                    # and clear_turn record it in _turn_out: nothing reads it between)
                    renew(queue, r)
            else:
                for x, _, k, _ in taken:
                    x._stage0 += k
                    done = x._scheduled if cache_aware else x._scheduled - x.num_cached_tokens
                    x.remaining_work = remaining(x.num_prefill_tokens, done)
                    if shared:
                        renew(queue, x)
            s = f
        for lane_s, k in sampled.items():
            tokens = [0] * k
            for m in lane_s.members:
                m.request.output_token_ids.extend(tokens)
        if not starts and plain is None:
            return None
        count = len(starts)
        ended_turns = head - before if head > before else 0
        for i in range(ended_turns, count):
            _, lane_i, entries_i, _ = flying[before + i]  # turn i's batch
            in_flight[first + i] = _InFlight(
                entries_i, lane_i, stage0_cleared=cleared or i < count - 1
            )
        formed = None
        if plain is not None:  # issued after the turns (batches end in issue order)
            draft, lane, chosen = plain
            self._queue.take(chosen)  # as the scan takes them
            self._clock = s
            formed = self._plain(draft, lane, s, [])
        return TurnRun(
            range(first, first + count),
            starts,
            chunks,
            prefills,
            times,
            decs,
            ends,
            s if cleared else float("nan"),
            ended,
            ended_turns,
            cleared,
            formed,
        )

    def _lane_time(
        self,
        base: list[float],
        nt: int,
        const: list[float] | None,
        times_of: dict[int, Callable[[float, float], float]] | None,
    ) -> float:
        """``group_time(base)`` of a lane's sums (``nt`` tail tokens) in a
        :meth:`turn_run`: where ``base = nt * a + kv * b`` (``const`` None and the
        run's ``times_of`` kept), the same float by the decode time function
        kept for ``nt``."""
        if times_of is None or const is not None:
            return self._one_group.group_time(base)  # type: ignore[union-attr]
        time_of = times_of.get(nt)
        if time_of is None:
            time_of = times_of[nt] = self._decode_time_of(base)
        return time_of(base[1], base[2])

    def _decode_time_of(self, base: list[float]) -> Callable[[float, float], float]:
        """``group_time`` of ``base`` (the one group's totals of a lane of decodes) as
        a function of its attended pairs and KV tokens (``base[1]``, ``base[2]``),
        the other totals fixed: the model's ``group_time_varying`` (its terms that
        do not move computed once), else ``group_time`` of the totals rebuilt;
        the same floats either way."""
        agg = self._one_group
        assert agg is not None
        time_of = agg.group_time_varying(base, 1, 2)
        if time_of is not None:
            return time_of
        q, _, _, qa, qm, nt = base
        group_time = agg.group_time

        def rebuilt(pairs: float, kv: float) -> float:
            return group_time([q, pairs, kv, qa, qm, nt])

        return rebuilt

    def clear_turn(self, batch_id: int) -> None:
        """A :meth:`prefill_turn` batch cleared stage 0 (``on_stage_end`` without
        putting the prefill back in the queue: its next turn follows)."""
        batch = self._in_flight[batch_id]
        batch.stage0_cleared = True
        if batch.lane is not None:
            self._lanes.cleared(batch.lane)
        out = self._turn_out
        for r, _, n, _ in batch.entries:
            r.num_stage0_tokens += n
            self._refresh_work(r)
            if out and r.request_id in out:
                # long prompts waiting together: it left the queue at its turn
                # and is queued again now (on_stage_end's push), in one step
                del out[r.request_id]
                self._queue.renew(r)

    def end_prefill_turns(self, request: Request | None, turns: int, queued: bool) -> None:
        """After ``turns`` :meth:`prefill_turn` calls: the request left the queue
        at the first and went back after each but the last; ``queued``: its
        last batch cleared stage 0 too (it waits in the queue again). None:
        turns of prompts waiting together; the prompts whose last turn has not
        cleared stage 0 leave the queue now, in the order they left it at the
        turn (as the scan took them out)."""
        queue = self._queue
        if request is None:
            if self._turn_out:  # its last turn has not cleared stage 0
                queue.remove_many(self._turn_out)  # in the order they left
                self._turn_out.clear()
            return
        queue.remove(request.request_id)
        queue.count_pushes(turns - 1)
        if queued:
            queue.push(request)

    # ---------------------------------------------------------------- results
    def on_stage_end(self, batch_id: int, *, stage: int = 0) -> None:
        """Batch ``batch_id`` cleared pipeline ``stage``; stage 0 frees its prefills."""
        batch = self._in_flight.get(batch_id)
        if batch is None:
            raise SchedulerError(f"unknown or finished batch id {batch_id!r}")
        if stage != 0 or batch.stage0_cleared:
            return
        batch.stage0_cleared = True
        lane = batch.lane
        if lane is not None:
            self._lanes.cleared(lane)
            if self._async and lane not in self._lanes.ready and self._may_issue_ahead(lane):
                self._lanes.ready.append(lane)  # its next decodes may go one ahead
        running, aborting = RequestStatus.RUNNING, self._abort_pending
        for r, _, n, _ in batch.entries:
            r.num_stage0_tokens += n
            if r.num_scheduled_tokens >= r.num_prefill_tokens:  # not prefilling
                continue
            if r.status is running and r.request_id not in aborting:
                self._refresh_work(r)
                self._queue.push(r)

    def on_batch_end(self, batch_id: int, result: BatchResult) -> tuple[str, ...]:
        """Take a batch's results back; returns the ids of requests that finished.

        Batches leave the pipeline in the order they were scheduled.
        """
        in_flight = self._in_flight
        oldest = next(iter(in_flight), None)
        if batch_id != oldest:
            if batch_id not in in_flight:
                raise SchedulerError(f"unknown or finished batch id {batch_id!r}")
            raise SchedulerError(
                f"batch {batch_id} ended before batch {oldest}: batches must end in order"
            )
        batch = in_flight[batch_id]
        if result.sampled_token_ids is not ZERO_TOKENS:
            self._check_result(batch, result)
        if not batch.stage0_cleared:
            self.on_stage_end(batch_id, stage=0)
        del in_flight[batch_id]
        finished: list[str] = []
        lane = batch.lane
        if lane is not None:
            if self._async and lane in self._lanes.ready:
                self._lanes.ready.remove(lane)  # ready to go ahead, not issued: back below
            # With async_decodes a member that finishes here may have its next
            # decode in the batch after this one (issued ahead): that batch's
            # result for it is dropped (it is no member any more), and the KV
            # freed now goes only to batches formed from now on, which the
            # in-process executor runs after that one (batches run in order).
            self._end_decodes(lane, result, finished)
            if self._async and self._settle_ahead(lane):
                lane = None  # a batch of it is in flight: the prefills below start a lane
            elif lane not in self._lanes.ready:
                lane = None  # every decode finished: the lane is gone
        caching = self._caching
        for r, _, n, samples in batch.entries:
            r.num_computed_tokens += n
            if caching and r.request_id in self._running:
                self._register(r)  # its KV ran on every stage: the next request may use it
            status = self._after_compute(r, samples, result)
            if status is not None:
                self._finish(r, status)
                finished.append(r.request_id)
            elif samples and r.status is RequestStatus.RUNNING:
                if lane is None:
                    lane = self._lane_to_join() if self._async else self._lanes.new_lane()
                rid = r.request_id
                self._lanes.join(lane, self._seq_of[rid], r)
                if self._async and lane.issued != lane.computed:
                    self._fresh.setdefault(lane, {})[rid] = lane.index[rid]
        return tuple(finished)

    def _lane_to_join(self) -> Lane:
        """``async_decodes``: the lane a request whose prefill just ended joins: the only
        ready lane if it has no batch in flight, or one that cleared stage 0 (then the
        request joins fresh: :meth:`DecodeLanes.returned_fresh`); else a new lane."""
        ready = self._lanes.ready
        if len(ready) == 1:
            lane = ready[0]
            lag = lane.issued - lane.computed
            if lag == 0 or (lag == 1 and lane.cleared == lane.issued):
                return lane
        return self._lanes.new_lane()

    def _end_decodes(self, lane: Lane, result: BatchResult, finished: list[str]) -> None:
        """A lane's batch ended: tokens in, finished decodes out (in running order)."""
        lanes, aborting = self._lanes, self._abort_pending
        aborted = {rid for rid in aborting if lanes.where.get(rid) is lane} if aborting else set()
        fresh = self._fresh.pop(lane, None) if self._fresh else None
        if fresh:
            reached = lanes.returned_fresh(lane, result.sampled_token_ids, aborted, fresh)
        else:
            reached = lanes.returned(lane, result.sampled_token_ids, aborted)
        if not (aborted or reached or result.stopped):
            return
        ends: list[tuple[Member, RequestStatus]] = []
        for rid in aborted:
            aborting.discard(rid)
            ends.append((lane.index[rid], RequestStatus.FINISHED_ABORTED))
        stopped = {rid for rid in result.stopped if rid not in aborted and rid in lane.index}
        for rid in stopped:
            ends.append((lane.index[rid], RequestStatus.FINISHED_STOPPED))
        for m in reached:
            if m.request.request_id not in stopped:
                ends.append((m, RequestStatus.FINISHED_LENGTH))
        ends.sort(key=lambda e: e[0].seq)
        for m, status in ends:
            self._finish(m.request, status)
            finished.append(m.request.request_id)

    def _check_result(self, batch: _InFlight, result: BatchResult) -> None:
        """The result names a token for every sampling row (the caller skips
        ``ZERO_TOKENS``, which holds every request's token)."""
        tokens = result.sampled_token_ids
        if batch.lane is not None:
            fresh = self._fresh.get(batch.lane, ()) if self._fresh else ()
            for m in batch.lane.members:
                rid = m.request.request_id
                token = tokens.get(rid, _MISSING)
                if token is _MISSING:
                    if rid not in fresh:
                        raise SchedulerError(
                            f"batch result has no sampled token for request {rid!r}"
                        )
                elif type(token) is not int:
                    _check_token(rid, token)
        for r, _, _, samples in batch.entries:
            if samples:
                token = tokens.get(r.request_id, _MISSING)
                if token is _MISSING:
                    raise SchedulerError(
                        f"batch result has no sampled token for request {r.request_id!r}"
                    )
                if type(token) is not int:
                    _check_token(r.request_id, token)

    def _after_compute(
        self, request: Request, samples: bool, result: BatchResult
    ) -> RequestStatus | None:
        rid = request.request_id
        if rid in self._abort_pending and not request.in_flight:
            self._abort_pending.discard(rid)
            return RequestStatus.FINISHED_ABORTED
        if not samples or request.status is not RequestStatus.RUNNING:
            return None
        request.output_token_ids.append(int(result.sampled_token_ids[rid]))
        if rid in result.stopped:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _reprice(self) -> None:
        """The cost model learned: re-price the prefill work of queued requests
        (their deadlines stay as fixed at arrival)."""
        queue = self._queue
        for request in self._requests.values():
            if request.request_id in queue:
                before = request.remaining_work
                self._refresh_work(request)
                if before > 0:  # total work moves with it, whatever it counts
                    request.total_work *= request.remaining_work / before
                queue.push(request)

    def _refresh_work(self, request: Request) -> None:
        done = request.num_scheduled_tokens
        if not self.config.cache_aware_slack:
            done -= request.num_cached_tokens  # priced as if the whole prompt were computed
        request.remaining_work = self.prefill_times.remaining_time(request.num_prefill_tokens, done)

    # ----------------------------------------------------------- prefix cache
    def _hashes(self, request: Request, num_tokens: int) -> list:
        """Content hashes of the request's full blocks among its first
        ``num_tokens`` positions, as far as they are known (computed once)."""
        hashes = request.block_hashes
        bs = self.cache.block_size
        want = num_tokens // bs
        if len(hashes) >= want:
            return hashes
        if request.prompt_token_ids is not None:
            tokens = request.token_ids(len(hashes) * bs, want * bs)
            extend_token_hashes(hashes, tokens, bs, salt=request.cache_salt)
        elif request.prefix_id is not None:
            num = min(want, request.prefix_tokens // bs)
            extend_stream_hashes(hashes, request.prefix_id, num, salt=request.cache_salt)
        return hashes

    def _lookup_hashes(self, request: Request) -> list:
        """Hashes to look the request's prefill up with (none when it opts out)."""
        if not request.prefix_caching:
            return []
        return self._hashes(request, request.num_prefill_tokens)

    def _register(self, request: Request) -> None:
        """Offer the request's computed full blocks to the prefix cache."""
        if (
            not request.block_hashes
            and request.prompt_token_ids is None
            and request.prefix_id is None
        ):
            return  # no block of it can be hashed: register_blocks would offer none
        self._offer_blocks(request)

    def _offer_blocks(self, request: Request) -> None:
        """:meth:`_register` past its first test (the request has a block to hash)."""
        done = request.num_computed_tokens
        self.memory.register_blocks(request.request_id, self._hashes(request, done), done)

    @staticmethod
    def _set_cursors(request: Request, position: int) -> None:
        request.num_scheduled_tokens = position
        request.num_stage0_tokens = request.num_computed_tokens = position

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        self._queue.remove(rid)
        self._sizer.forget(rid)
        if rid in self._lanes:
            self._lanes.leave(request)
        self._tpot.pop(rid, None)
        if rid in self._running:
            del self._seq_of[rid]
            if self._caching:
                self._register(request)  # decoded tokens' KV too
            self.memory.free(rid)
            del self._running[rid]
        request.status = status
        self._requests.pop(rid, None)

    # ----------------------------------------------------------------- budget
    def set_target_batch_time(self, target_batch_time: float) -> None:
        """Change the iteration budget T (seconds) from the next batch on.

        Rebuilds what T shapes: :attr:`config` (a copy with the new T), the
        prefill-time table (chunks are simulated against T) and the queued
        requests' remaining work (their deadlines stay as fixed at arrival).
        With a learning cost model the feasibility table (which prompts can
        be prefilled at all) stays as built at start-up, on the frozen model
        and the T of that time, so a changed budget never starts refusing
        prompts; with a fixed model it follows the new table.
        Batches already formed keep the budget they were packed against.

        Raises:
            ValueError: ``target_batch_time`` is not a finite number > 0.
        """
        config = replace(self.config, target_batch_time=target_batch_time)
        shared = self._feasibility is self.prefill_times
        self.config = config
        self.prefill_times = PrefillTimeCache(
            self.cost_model,
            target_time=config.target_batch_time,
            token_grid=config.token_grid,
            max_chunk_tokens=config.max_chunk_tokens,
            group_token_limit=self.group_limit,
        )
        if shared:
            self._feasibility = self.prefill_times
        self._reprice()
