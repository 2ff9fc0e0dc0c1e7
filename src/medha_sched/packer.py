"""Batch packing (the paper's Alg. 1 and 2).

Running decodes go in first. Prefill chunks follow in policy order; each is
the largest chunk on the token grid whose batch still fits the budget (a
long prefill under space sharing gets ``T * (1 - clamp(rho, 0, rho_max))``),
at most one long prefill per KVP group, never crossing a KVP shard.

Guarantee: with adaptive chunking the predicted batch time is <= T. The
exceptions keep everyone moving: decodes that alone exceed T still run (and
no prefill is added), and when nothing runs or is in flight and no chunk fits
(a learning cost model can price every chunk over T) the first request that
KV memory allows takes one grid chunk. With a fixed chunk size the budget is
in tokens instead (Sarathi-style), and with ``chunk_size=0`` prompts go whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import add as _add

from medha_sched.batch_cost import BatchCost, Work, chunk_works
from medha_sched.chunking import (
    largest_chunk_priced,
    largest_fitting_chunk,
)
from medha_sched.config import SchedulerConfig
from medha_sched.policies.base import Policy, relative_slack
from medha_sched.request import Request


@dataclass(slots=True)
class Draft:
    """A batch being formed: its decodes (a count, priced first), then prefill chunks."""

    cost: BatchCost
    target: float
    entries: list[tuple[Request, int]] = field(default_factory=list)  # prefill chunks
    num_decodes: int = 0
    #: running decodes that hold a place in the batch (``async_decodes``: those
    #: held back for a batch in flight count too); prefills fill the rest
    held_decodes: int = 0
    long_groups: set[int] = field(default_factory=set)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_tokens: int = 0
    num_prefills: int = 0
    # (group, kv, tokens, target) of smallest chunks that did not fit the
    # draft as it is: any chunk on that group with at least that KV and
    # tokens, against no larger a target, cannot fit either (monotone model).
    misses: list[tuple[int, int, int, float]] = field(default_factory=list)
    # Smallest chunk size that fits on no group even at KV 0 against the
    # draft's target: no chunk at least this big can join (monotone model).
    floor: int | None = None
    # Largest chunk size seen to fit on some group at KV 0 against the
    # draft's target: no smaller chunk can become the floor (monotone model).
    fits_somewhere: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_decodes + len(self.entries)

    def known_miss(self, group: int, kv: int, tokens: int, target: float) -> bool:
        return any(
            g == group and kv >= k and tokens >= q and target <= t for g, k, q, t in self.misses
        )

    def add(self, request: Request, num_tokens: int, works: list[Work]) -> None:
        self.misses.clear()
        self.floor = None
        self.fits_somewhere = 0
        self.cost.add(works)
        self.entries.append((request, num_tokens))
        self.num_tokens += num_tokens

    def set_decodes(self, count: int) -> None:
        """The draft holds ``count`` decodes, already priced into ``cost`` (first)."""
        assert not self.entries and not self.num_decodes, "decodes go first, once"
        self.num_decodes = count
        self.num_tokens += count


class ChunkSizer:
    """Decides how many prompt tokens of one request go into a draft."""

    def __init__(self, config: SchedulerConfig, policy: Policy, group_limit: int) -> None:
        self._cfg = config
        self._policy = policy
        self._limit = group_limit
        # each prefilling request's latest adaptive chunk: where the next search starts
        self._last_chunk: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        """Drop what is remembered about a request (it finished or left)."""
        self._last_chunk.pop(request_id, None)

    def hint(self, request_id: str) -> int | None:
        """The chunk the next search for ``request_id`` starts from (None: none)."""
        return self._last_chunk.get(request_id)

    def set_hint(self, request_id: str, chunk: int | None) -> None:
        """Put back what :meth:`hint` gave (a chunk that was sized but not issued)."""
        if chunk is None:
            self._last_chunk.pop(request_id, None)
        else:
            self._last_chunk[request_id] = chunk

    def room(self, request: Request) -> int:
        """Largest chunk allowed by what is left, the max chunk and the shard."""
        start = request.num_scheduled_tokens
        return min(
            request.num_prefill_tokens - start,
            self._cfg.max_chunk_tokens,
            self._limit - start % self._limit,
        )

    def fixed(self, request: Request, draft: Draft) -> int:
        """Chunk under a token budget (``chunk_size`` > 0) or no chunking (0)."""
        size = self._cfg.chunk_size
        assert size is not None
        room = request.num_prefill_tokens - request.num_scheduled_tokens
        room = min(room, self._limit - request.num_scheduled_tokens % self._limit)
        if size == 0:
            fits = draft.num_prefills == 0 or draft.num_tokens + room <= self._cfg.max_chunk_tokens
            return room if fits else 0
        return max(0, min(room, size - draft.num_tokens))

    def adaptive(
        self,
        request: Request,
        groups: tuple[int, ...],
        draft: Draft,
        now: float,
        *,
        force: bool = False,
    ) -> tuple[int, bool]:
        """``(chunk, is_long)``: the largest grid chunk that keeps the draft in budget.

        ``force``: one grid chunk (or what is left of the shard or prompt) even when
        none fits, for an empty batch that must make progress.
        """
        start = request.num_scheduled_tokens
        limit_g, cfg = self._limit, self._cfg
        is_long = request.num_prefill_tokens >= cfg.long_prefill_threshold
        target = draft.target
        if is_long:
            if draft.long_groups.intersection(groups[: start // limit_g + 1]):
                return 0, is_long
            if self._policy.space_sharing:
                rho = min(cfg.max_space_share, max(0.0, relative_slack(request, now)))
                target *= 1.0 - rho
        cost = draft.cost
        if cost.time >= target:
            return 0, is_long
        # room(): what is left, the max chunk and the shard
        limit = request.num_prefill_tokens - start
        if cfg.max_chunk_tokens < limit:
            limit = cfg.max_chunk_tokens
        if limit_g - start % limit_g < limit:
            limit = limit_g - start % limit_g
        grid = cfg.token_grid
        single = start < limit_g  # one shard: the draft's miss memo applies
        if single:
            group = groups[0]
            if (
                not force
                and draft.misses
                and draft.known_miss(group, start, min(grid, limit), target)
            ):
                return 0, is_long
        else:

            def fits(n: int) -> bool:
                return cost.time_with(chunk_works(groups, start, n, limit_g)) <= target

        rid = request.request_id
        last = self._last_chunk
        hint = last.get(rid, 0)
        if single:
            # largest_chunk_within(limit, grid, lambda n: cost.time_with_tail(group, n,
            # start), target, base=cost.time, hint=hint): the same chunk
            chunk = cost.largest_tail_chunk(group, start, limit, grid, target, hint)
        else:
            chunk = largest_fitting_chunk(limit, grid, fits, hint=hint)
        if chunk == 0 and force:
            chunk = min(grid, limit)
        if chunk == 0:
            if single:
                draft.misses.append((group, start, min(grid, limit), target))
        elif start + chunk < request.num_prefill_tokens:
            last[rid] = chunk
        elif hint:
            del last[rid]  # the prefill is fully issued
        return chunk, is_long

    def adaptive_alone(
        self,
        request: Request,
        group_time: Callable[[Sequence[float]], float],
        features: Callable[[int, int, bool], tuple[float, ...]],
        base: list[int] | None,
        base_time: float,
        target: float,
        now: float,
        chunk_time: Callable[[Sequence[float] | None, int], Callable[[int], float] | None]
        | None = None,
    ) -> tuple[int, float]:
        """:meth:`adaptive` on a fresh draft of an aggregate model with one KVP
        group, holding only summed features ``base`` (None: nothing) priced
        ``base_time``, for a chunk in the prompt's first shard: ``(chunk, the
        batch's seconds with it)``, ``(0, 0.0)`` when none fits.

        The same probes and sums as :meth:`adaptive` with a :class:`BatchCost`
        (``_totals_with``: ``base + features`` term by term), without the
        draft. Leaves the hint alone: the caller sets it (:meth:`set_hint`)
        once the chunk is issued, as :meth:`adaptive` would have left it.
        ``chunk_time``: the model's ``chunk_time_fn`` (the same floats in one
        call a probe), used when it gives a function.
        """
        start = request.num_scheduled_tokens
        cfg = self._cfg
        if request.num_prefill_tokens >= cfg.long_prefill_threshold and self._policy.space_sharing:
            rho = min(cfg.max_space_share, max(0.0, relative_slack(request, now)))
            target *= 1.0 - rho
        if base_time >= target:
            return 0, 0.0
        limit = request.num_prefill_tokens - start
        if cfg.max_chunk_tokens < limit:
            limit = cfg.max_chunk_tokens
        limit_g = self._limit
        if limit_g - start % limit_g < limit:
            limit = limit_g - start % limit_g
        fn = None if chunk_time is None else chunk_time(base, start)
        if fn is not None:

            def price(_base: list[int] | None, _start: int, n: int) -> float:
                return fn(n)

        elif base is None:

            def price(_base: list[int] | None, at: int, n: int) -> float:
                return group_time(list(features(n, at, True)))

        else:

            def price(summed: list[int], at: int, n: int) -> float:
                return group_time(list(map(_add, summed, features(n, at, True))))

        # largest_chunk_within's search, keeping the chosen chunk's probed time
        return largest_chunk_priced(
            limit,
            cfg.token_grid,
            price,
            base,
            start,
            target,
            base_time,
            self._last_chunk.get(request.request_id, 0),
        )
