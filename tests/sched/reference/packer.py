"""Batch packing (the paper's Alg. 1 and 2).

Running decodes go in first. Prefill chunks follow in policy order; each is
the largest chunk on the token grid whose batch still fits the budget (a
long prefill under space sharing gets ``T * (1 - clamp(rho, 0, rho_max))``),
at most one long prefill per KVP group, never crossing a KVP shard.

Guarantee: with adaptive chunking the predicted batch time is <= T. The one
exception is decodes that alone exceed T: then no prefill is added (the
decodes still run, so nobody starves). With a fixed chunk size the budget is
in tokens instead (Sarathi-style), and with ``chunk_size=0`` prompts go whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medha_sched.chunking import largest_fitting_chunk
from medha_sched.config import SchedulerConfig
from medha_sched.policies.base import Policy, relative_slack
from medha_sched.request import Request

from .batch_cost import BatchCost, Work, chunk_works


@dataclass
class Draft:
    """A batch being formed."""

    cost: BatchCost
    target: float
    entries: list[tuple[Request, int]] = field(default_factory=list)
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

    def add_decodes(self, requests: list[Request], works: list[Work]) -> None:
        """Add one token for each of ``requests``, priced in a single pass."""
        self.misses.clear()
        self.floor = None
        self.fits_somewhere = 0
        self.cost.add(works)
        self.entries.extend([(r, 1) for r in requests])
        self.num_tokens += len(requests)


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
        """``(chunk, is_long)``: the largest grid chunk that keeps the draft in budget
        (``force``: one grid chunk even when none fits, for an empty batch)."""
        start = request.num_scheduled_tokens
        active = groups[: start // self._limit + 1]
        is_long = request.num_prefill_tokens >= self._cfg.long_prefill_threshold
        if is_long and draft.long_groups.intersection(active):
            return 0, is_long
        target = draft.target
        if is_long and self._policy.space_sharing:
            rho = min(self._cfg.max_space_share, max(0.0, relative_slack(request, now)))
            target *= 1.0 - rho
        cost = draft.cost
        if cost.time >= target:
            return 0, is_long
        limit = self.room(request)
        smallest = min(self._cfg.token_grid, limit)
        single = start < self._limit  # one shard: the draft's miss memo applies
        if not force and single and draft.known_miss(groups[0], start, smallest, target):
            return 0, is_long

        if single:
            group = groups[0]

            def fits(n: int) -> bool:
                return cost.time_with([(group, n, start, True)]) <= target
        else:

            def fits(n: int) -> bool:
                return cost.time_with(chunk_works(groups, start, n, self._limit)) <= target

        rid = request.request_id
        hint = self._last_chunk.get(rid, 0)
        chunk = largest_fitting_chunk(limit, self._cfg.token_grid, fits, hint=hint)
        if chunk == 0 and force:
            chunk = smallest
        if chunk == 0:
            if single:
                draft.misses.append((groups[0], start, smallest, target))
        elif start + chunk < request.num_prefill_tokens:
            self._last_chunk[rid] = chunk
        elif hint:
            del self._last_chunk[rid]  # the prefill is fully issued
        return chunk, is_long
