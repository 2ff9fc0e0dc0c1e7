"""Predicted prefill time of a request alone, with adaptive chunking (Alg. 3).

The table is built in one pass: a request of unbounded length is chunked
exactly as the packer would chunk it alone (the largest grid chunk whose
predicted time fits T, never crossing a KVP shard), and the cumulative time
is recorded at every chunk boundary ``b_k``. A prompt of length ``L`` with
``b_k <= L < b_{k+1}`` takes ``C(b_k)`` plus one last, shorter chunk of
``L - b_k`` tokens at KV ``b_k`` (the last-chunk correction). ``C`` is
therefore exact at every length, non-decreasing, and ``C(0) = 0``.

A learning cost model (one with a ``revision``) makes the table stale when
its coefficients move: :meth:`PrefillTimeCache.refresh` rebuilds it then, at
most once per ``refresh_interval`` seconds of the caller's clock (a table out
to 1M tokens takes ~0.2 s to build in pure Python; it orders the queue, while
the packer always prices batches with the live model).

Lookups beyond the built range extend the same simulation on demand (the
table doubles), so no length ever raises. Where even the smallest grid
chunk alone exceeds T the simulation still advances by one grid chunk, and
``max_feasible_tokens`` records that position plus the largest shorter final
piece that still fits: a longer prompt can never meet the budget, and the
scheduler rejects it.

With SPP depth ``s`` chunks overlap across stages, so the remaining time is
``(C(P) - C(done)) / s`` plus a pipeline-fill term ``(1 - 1/s) * T``.
"""

from __future__ import annotations

import bisect
import math
from array import array

from medha_sched.batch_cost import BatchCost, chunk_works
from medha_sched.chunking import largest_fitting_chunk
from medha_sched.config import _check_float, _check_int
from medha_sched.cost.base import AggregateCostModel, CostModel

_RECENT_MAX = 1 << 16
_AT_MAX = 1 << 20
"""Positions whose C(L) :meth:`PrefillTimeCache.remaining_time` keeps in an array
indexed by position (at most 8 MiB of doubles); past them it asks the memo."""
_UNKNOWN = array("d", [-1.0])  # a position not asked yet


class PrefillTimeCache:
    """Remaining prefill time of a request, in seconds.

    Args:
        model: the cost model.
        target_time: the iteration budget T in seconds.
        token_grid: chunk granularity in tokens.
        max_chunk_tokens: the largest chunk.
        group_token_limit: tokens per KVP shard (Gmax).
        initial_tokens: length the table is first built to.
    """

    def __init__(
        self,
        model: CostModel,
        *,
        target_time: float,
        token_grid: int,
        max_chunk_tokens: int,
        group_token_limit: int,
        initial_tokens: int = 8192,
    ) -> None:
        # the scheduler passes its validated config; checked here for a cache built alone
        # (a zero chunk limit looped forever, a zero shard divided by zero)
        _check_float("target_time", target_time, minimum=0.0, strict=True)
        for name, value in (
            ("token_grid", token_grid),
            ("max_chunk_tokens", max_chunk_tokens),
            ("group_token_limit", group_token_limit),
        ):
            _check_int(name, value, minimum=1)
        _check_int("initial_tokens", initial_tokens, minimum=0)
        self._model = model
        self._target = target_time
        self._grid = token_grid
        self._max_chunk = max_chunk_tokens
        self._limit = group_token_limit
        self._spp = model.layout.spp
        self._fill = (1.0 - 1.0 / self._spp) * target_time  # the pipeline-fill term
        self._initial = initial_tokens
        self._built_at = -math.inf
        self._build(initial_tokens)

    def _build(self, num_tokens: int) -> None:
        """(Re)build the table from the model's current predictions."""
        self.revision = getattr(self._model, "revision", 0)
        model = self._model
        # one call a chunk where the model has it (the same floats as group_time)
        self._price = _pricer(model)
        self._bounds: list[int] = [0]
        self._cum: list[float] = [0.0]
        # C(L) of lengths between boundaries, as computed (the table never
        # changes below its end, so they stay exact): a prompt's length is
        # looked up again every time its prefill progresses
        self._recent: dict[int, float] = {}
        # C(L) of the lengths and done positions remaining_time is asked for,
        # at L (-1.0: not asked yet): one index into a flat array instead of a
        # probe of the large memo, whose entries a run scatters (prefill_time's
        # floats, boundaries included, which the memo does not keep)
        self._at = array("d")
        self.max_feasible_tokens = math.inf
        self._extend_to(num_tokens)

    def __getstate__(self) -> dict:
        """Pickled without the model's chunk pricer (a closure); :meth:`__setstate__`
        asks the model for it again (the same floats: it is a function of the
        model's coefficients)."""
        state = self.__dict__.copy()
        state["_price"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._price = _pricer(self._model)
        if "_fill" not in state:  # pickled before the term was kept
            self._fill = (1.0 - 1.0 / self._spp) * self._target
        if "_at" not in state:  # pickled before the positions were kept
            self._at = array("d")

    def current(self) -> bool:
        """Whether the table is of the model's current revision: :meth:`refresh`
        then answers False, whatever the time, until the revision moves."""
        return getattr(self._model, "revision", 0) == self.revision

    def refresh(self, now: float, refresh_interval: float = 10.0) -> bool:
        """Rebuild the table if the model's revision changed and the last
        rebuild is ``refresh_interval`` seconds before ``now``; True if it did.

        The new table starts short and extends on demand, as the first did.
        """
        if getattr(self._model, "revision", 0) == self.revision:
            return False
        if now < self._built_at + refresh_interval:
            return False
        self._build(self._initial)
        self._built_at = now
        return True

    @property
    def built_tokens(self) -> int:
        """Length up to which the table has been simulated."""
        return self._bounds[-1]

    def prefill_time(self, num_tokens: int) -> float:
        """C(L): seconds to prefill ``num_tokens`` alone, stage time summed."""
        known = self._recent.get(num_tokens)  # (only lengths >= 0 within the table)
        if known is not None:
            return known
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
        if num_tokens > self._bounds[-1]:
            self._extend_to(max(num_tokens, 2 * self._bounds[-1]))
        k = bisect.bisect_right(self._bounds, num_tokens) - 1
        base = self._bounds[k]
        if base == num_tokens:
            return self._cum[k]
        value = self._cum[k] + self._chunk_time(base, num_tokens - base)
        if len(self._recent) >= _RECENT_MAX:
            self._recent.clear()
        self._recent[num_tokens] = value
        return value

    def remaining_time(self, num_tokens: int, num_done: int) -> float:
        """Predicted seconds to prefill positions ``[num_done, num_tokens)``.

        Never negative, 0 when nothing is left, and non-decreasing in
        ``num_tokens``.
        """
        if num_done >= num_tokens or num_done < 0:
            if num_done < 0 or num_tokens < 0:
                raise ValueError(f"token counts must be >= 0, got {num_tokens!r}, {num_done!r}")
            return 0.0
        # 0 <= num_done < num_tokens; C(0) = 0.0 (the table's first entry)
        at = self._at
        try:
            total = at[num_tokens]
        except IndexError:
            total = -1.0
        if total < 0.0:  # not kept (or a negative time: asked again, the same float)
            total = self._kept_time(num_tokens)
        if num_done:
            try:
                done = at[num_done]
            except IndexError:
                done = -1.0
            if done < 0.0:
                done = self._kept_time(num_done)
            span = total - done
            if not span > 0.0:  # max(0.0, span)
                span = 0.0
        else:
            span = total if total > 0.0 else 0.0
        return span / self._spp + self._fill

    def _kept_time(self, num_tokens: int) -> float:
        """``prefill_time(num_tokens)``, kept at ``_at[num_tokens]`` when
        ``num_tokens`` is below ``_AT_MAX``."""
        value = self.prefill_time(num_tokens)
        if num_tokens >= _AT_MAX:
            return value
        at = self._at
        if num_tokens >= len(at):
            size = min(max(num_tokens + 1, 2 * len(at)), _AT_MAX)
            at.extend(_UNKNOWN * (size - len(at)))
        at[num_tokens] = value
        return value

    def _chunk_time(self, start: int, num_tokens: int) -> float:
        model = self._model
        if start < self._limit and isinstance(model, AggregateCostModel):
            # one shard, alone in the batch: the sums BatchCost would form
            price = self._price
            if price is not None:
                return price(None, start, num_tokens)
            return model.group_time([0 + f for f in model.features(num_tokens, start, True)])
        kvp = self._model.layout.kvp
        # Past kvp shards a request cannot exist; fold extra shards onto the
        # groups so that lookups there stay defined and monotone.
        groups = [i % kvp for i in range(start // self._limit + 1)]
        cost = BatchCost(self._model, kvp)
        return cost.time_with(chunk_works(groups, start, num_tokens, self._limit))

    def _extend_to(self, num_tokens: int) -> None:
        done, total = self._bounds[-1], self._cum[-1]
        chunk = done - self._bounds[-2] if len(self._bounds) > 1 else 0
        while done < num_tokens:
            room = self._limit - done % self._limit
            limit = min(self._max_chunk, room)
            chunk = largest_fitting_chunk(
                limit,
                self._grid,
                lambda n, d=done: self._chunk_time(d, n) <= self._target,
                hint=chunk,  # chunks shrink slowly along a prompt
            )
            if chunk == 0:
                smallest = min(self._grid, limit)
                tail = largest_fitting_chunk(
                    smallest - 1, 1, lambda n, d=done: self._chunk_time(d, n) <= self._target
                )
                self.max_feasible_tokens = min(self.max_feasible_tokens, done + tail)
                chunk = smallest
            total += self._chunk_time(done, chunk)
            done += chunk
            self._bounds.append(done)
            self._cum.append(total)


def _pricer(model: CostModel):
    """The model's one-call chunk pricer (same floats as ``group_time``), or None."""
    return model.chunk_price() if isinstance(model, AggregateCostModel) else None
