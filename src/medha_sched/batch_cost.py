"""Price a batch as it is being built.

A *work* is ``(group, q_tokens, kv_tokens, tail)``: one request's share of the
iteration on one KVP group (see :mod:`medha_sched.cost.base`). For an
:class:`AggregateCostModel` a candidate is priced in O(groups) by adding its
features to running per-group totals; any other :class:`CostModel` is called
on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import add as _add

from medha_sched.chunking import largest_chunk_priced
from medha_sched.cost.base import AggregateCostModel, BatchWork, CostModel, RequestWork

Work = tuple[int, int, int, bool]


def chunk_works(groups: Sequence[int], start: int, num_tokens: int, group_limit: int) -> list[Work]:
    """The works of a chunk at positions ``[start, start + num_tokens)``.

    Shard ``i`` holds positions ``[i*G, (i+1)*G)`` on ``groups[i]``. Earlier
    shards are full and only attend; the shard holding ``start`` is the tail.
    The chunk must not cross a shard boundary.
    """
    if 0 <= start < group_limit:  # the first shard is the tail: the common case, at once
        return [(groups[0], num_tokens, start, True)]
    tail = start // group_limit
    works: list[Work] = [(groups[i], num_tokens, group_limit, False) for i in range(tail)]
    works.append((groups[tail], num_tokens, start - tail * group_limit, True))
    return works


class BatchCost:
    """Running prediction of a batch's time.

    Attributes:
        time: predicted seconds of the works added so far.
    """

    __slots__ = (
        "_agg",
        "_fits",
        "_group_times",
        "_items",
        "_model",
        "_num_groups",
        "_price",
        "_probes",
        "_search",
        "_totals",
        "time",
    )

    def __init__(
        self,
        model: CostModel,
        num_groups: int,
        *,
        price: Callable[[Sequence[float] | None, int, int], float] | None = None,
    ) -> None:
        """``price``: ``model.chunk_price()`` (the same floats as ``group_time`` of
        the sums, in one call), for one-group tail probes; None: summed here."""
        agg = model if isinstance(model, AggregateCostModel) else None
        price = price if agg is not None and num_groups == 1 else None
        # the price's own search (the roofline's; see chunking.chunk_search) and
        # growth bound (see fits_tail), if any
        search, fits = getattr(price, "search", None), getattr(price, "fits_after", None)
        self._start(model, num_groups, agg, price, search, fits)

    def _start(
        self,
        model: CostModel,
        num_groups: int,
        agg: AggregateCostModel | None,
        price: Callable[[Sequence[float] | None, int, int], float] | None,
        search: Callable | None,
        fits: Callable[[float, int, float], bool | None] | None,
    ) -> None:
        """An empty batch: ``__init__``'s state, its checks made."""
        self._model = model
        self._num_groups = num_groups
        self._agg = agg
        self._totals: list[list[float] | None] = [None] * num_groups
        self._group_times = [0.0] * num_groups
        # the works themselves, kept only for models priced on the whole batch
        self._items: list[list[RequestWork]] = (
            [] if agg is not None else [[] for _ in range(num_groups)]
        )
        self.time = 0.0
        # work -> (totals, time) of the one-work probes since the batch last changed
        # (totals None: not summed yet, a ``price`` probe; add() sums them)
        self._probes: dict[Work, tuple[list[float] | None, float]] = {}
        self._price = price
        self._search = search
        self._fits = fits

    def empty(self) -> BatchCost:
        """A new empty batch priced as this one is (its model, groups and price):
        ``BatchCost(model, num_groups, price=price)`` without the checks (a
        draft a step, from one kept by the scheduler)."""
        new = object.__new__(BatchCost)
        new._start(self._model, self._num_groups, self._agg, self._price, self._search, self._fits)
        return new

    def tail_batch(self, totals: list[float] | None, work: Work, time: float) -> BatchCost:
        """A new batch (:meth:`empty`) seeded with ``totals`` (None: nothing), then
        ``note_tail`` of ``work`` at ``time`` and ``add([work])``, in one step: the
        state those calls leave (the totals summed as ``add`` sums them, ``time``
        the batch's; a scan turn's draft, see ``Scheduler._joined_draft``). One
        group, priced by the model's ``chunk_price``; ``work`` one chunk in its
        tail shard on group 0."""
        assert self._num_groups == 1 and self._price is not None, "a priced one-group batch"
        assert work[0] == 0 and work[3], "a tail chunk on group 0"
        new = self.empty()
        new._totals[0] = totals
        new._totals[0] = new._totals_with(work)
        new.time = new._group_times[0] = time
        return new

    def seed(self, totals: Sequence[list[int] | None]) -> None:
        """Start an empty batch from summed features per group (None: an idle group).

        Gives the state ``add`` of works with those sums leaves behind.
        Aggregate models only.
        """
        agg = self._agg
        assert agg is not None and self.time == 0.0, "seed an empty aggregate batch"
        for g, t in enumerate(totals):
            if t is not None:
                self._totals[g] = t
                self._group_times[g] = agg.group_time(t)
        self.time = max(self._group_times)
        self._probes = {}  # probed against the empty batch

    def seed_priced(self, totals: list[int] | None, time: float) -> None:
        """``seed([totals])`` of a one-group batch whose time the caller has:
        ``time`` must be ``group_time(totals)`` of this batch's model (0.0 for
        None), the float ``seed`` would compute; it is not computed again."""
        assert self._num_groups == 1 and self.time == 0.0, "seed an empty one-group batch"
        if totals is not None:  # (None: an idle group, the time stays 0.0)
            self._totals[0] = totals
            self.time = self._group_times[0] = time  # max(self._group_times), of one
        self._probes = {}  # probed against the empty batch

    def note_tail(self, group: int, q_tokens: int, kv_tokens: int, time: float) -> None:
        """Note ``time`` as ``time_with_tail(group, q_tokens, kv_tokens)``, which the
        caller priced with the model's ``chunk_price`` (or its search) against
        the batch as it is now: :meth:`add` of that chunk reuses it, as it
        reuses the probes of :meth:`largest_tail_chunk`. A batch without a
        price notes nothing (its :meth:`add` prices the chunk itself)."""
        if self._price is not None:
            self._probes[(group, q_tokens, kv_tokens, True)] = (None, time)

    def time_with(self, works: Sequence[Work]) -> float:
        """Predicted seconds if ``works`` were added (nothing changes)."""
        agg = self._agg
        if agg is None:
            return self._model.predict(self._batch_with(works))
        if len(works) == 1 and self._num_groups == 1:  # the hot path: one shard, one group
            work = works[0]
            totals = self._totals_with(work)
            time = agg.group_time(totals)
            self._probes[work] = (totals, time)  # add() of the same work reuses it
            return time
        return max(self._priced(works).values(), default=0.0) if works else self.time

    def fits_tail(self, q_tokens: int, target: float) -> bool | None:
        """``time_with_tail(0, q_tokens, 0) <= target`` told without pricing the
        chunk, by the price's bounds on how much a chunk at KV 0 adds to a
        batch of non-negative totals (the roofline's ``fits_after``): True or
        False, or None where not told (price it). One group, a batch with
        something in it. Notes no probe (an :meth:`add` of that chunk prices
        it, the same float)."""
        fits = self._fits
        if fits is None:
            return None
        totals = self._totals[0]
        if totals is None or not min(totals) >= 0:
            return None
        return fits(self.time, q_tokens, target)

    def time_with_tail(self, group: int, q_tokens: int, kv_tokens: int) -> float:
        """``time_with([(group, q_tokens, kv_tokens, True)])``: one chunk in one tail shard
        (:meth:`tail_price` with the arguments in this order)."""
        return self.tail_price(group, kv_tokens, q_tokens)

    def tail_price(self, group: int, kv_tokens: int, q_tokens: int) -> float:
        """``time_with_tail(group, q_tokens, kv_tokens)`` with the arguments in
        :func:`~medha_sched.chunking.largest_chunk_priced`'s ``price(base,
        start, n)`` order (``base`` is the group): the same sums, probe memo
        and float, one call a probe and no closure per search."""
        price = self._price
        if price is not None:  # one group: the model's price of the same sums
            time = price(self._totals[0], kv_tokens, q_tokens)
            self._probes[(group, q_tokens, kv_tokens, True)] = (None, time)
            return time
        agg = self._agg
        if agg is None or self._num_groups != 1:
            return self.time_with([(group, q_tokens, kv_tokens, True)])
        work = (group, q_tokens, kv_tokens, True)
        feats = agg.features(q_tokens, kv_tokens, True)  # _totals_with's sums, inline
        base = self._totals[group]
        totals = list(feats) if base is None else list(map(_add, base, feats))
        time = agg.group_time(totals)
        self._probes[work] = (totals, time)
        return time

    def largest_tail_chunk(
        self, group: int, start: int, limit: int, grid: int, target: float, hint: int
    ) -> int:
        """``largest_chunk_priced(limit, grid, self.tail_price, group, start, target,
        self.time, hint)``'s chunk: with the price's own search where it has
        one (the same chunk and time, fewer probes; only the chosen chunk's
        probe is noted for :meth:`add`), else that search itself."""
        search = self._search
        if search is None:
            return largest_chunk_priced(
                limit, grid, self.tail_price, group, start, target, self.time, hint
            )[0]
        chunk, time = search(limit, grid, self._totals[0], start, target, self.time, hint)
        if chunk:
            self._probes[(group, chunk, start, True)] = (None, time)
        return chunk

    def add(self, works: Sequence[Work]) -> None:
        """Add ``works`` to the batch."""
        agg = self._agg
        if agg is None:
            for g, q, kv, tail in works:
                self._items[g].append(RequestWork(q, kv, tail))
            self.time = self._model.predict(self._batch())
            return
        if not works:
            return  # nothing changes (the time is already the slowest group's)
        probes = self._probes
        if probes:  # the totals change: the probes go stale
            self._probes = {}
        if self._num_groups == 1 and len(works) == 1:
            # a search probes several sizes; the one chosen need not be the latest
            probe = probes.get(works[0]) if probes else None
            if probe is not None:
                totals, self.time = probe
                self._totals[0] = self._totals_with(works[0]) if totals is None else totals
                self._group_times[0] = self.time
                return
            totals = self._totals[0] = self._totals_with(works[0])
            self.time = self._group_times[0] = agg.group_time(totals)
            return
        if self._num_groups == 1:  # one group: running sums, in the order _priced adds them
            features = agg.features
            base = self._totals[0]
            totals = [0] * agg.num_features if base is None else [0 + b for b in base]
            for _, q, kv, tail in works:
                totals = [t + f for t, f in zip(totals, features(q, kv, tail), strict=True)]
            self._totals[0] = totals
            self.time = self._group_times[0] = agg.group_time(totals)
            return
        self._priced(works, commit=True)
        self.time = max(self._group_times)

    def _totals_with(self, work: Work) -> list[float]:
        """Group totals of ``work``'s group once ``work`` is added (same sums as ``_priced``)."""
        g, q, kv, tail = work
        assert self._agg is not None
        feats = self._agg.features(q, kv, tail)
        base = self._totals[g]
        return list(feats) if base is None else list(map(_add, base, feats))  # b + f

    def _priced(self, works: Sequence[Work], *, commit: bool = False) -> dict[int, float]:
        agg = self._agg
        assert agg is not None
        features = agg.features
        by_group: dict[int, list[tuple[float, ...]]] = {}
        for g, q, kv, tail in works:
            feats = by_group.get(g)
            if feats is None:
                feats = by_group[g] = []
                base = self._totals[g]
                if base is not None:
                    feats.append(tuple(base))
            feats.append(features(q, kv, tail))
        touched = {g: list(map(sum, zip(*feats, strict=True))) for g, feats in by_group.items()}
        times = {g: agg.group_time(t) for g, t in touched.items()}
        if commit:
            for g, t in touched.items():
                self._totals[g] = t
                self._group_times[g] = times[g]
        else:
            for g in range(self._num_groups):
                if g not in times:
                    times[g] = self._group_times[g]
        return times

    def _batch(self) -> BatchWork:
        return BatchWork(groups=tuple(tuple(items) for items in self._items))

    def _batch_with(self, works: Sequence[Work]) -> BatchWork:
        items = [list(x) for x in self._items]
        for g, q, kv, tail in works:
            items[g].append(RequestWork(q, kv, tail))
        return BatchWork(groups=tuple(tuple(x) for x in items))
