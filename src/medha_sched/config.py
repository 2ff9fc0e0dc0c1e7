"""Frozen, keyword-only configuration for the scheduler.

Values computed later (block counts, cached prefill times) live in separate
objects and are never written back into these configs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: object, *, minimum: float, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {op} {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDegrees:
    """Degrees of tensor (tp), stream-pipeline (spp) and KV-cache (kvp) parallelism.

    One replica has ``tp * spp * kvp`` workers. ``kvp`` is the number of KVP
    groups; each group is a full ``tp x spp`` pipeline holding a shard of the
    KV cache along the sequence.
    """

    tp: int = 1
    spp: int = 1
    kvp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "spp", "kvp"):
            _check_int(name, getattr(self, name), minimum=1)

    @property
    def world_size(self) -> int:
        return self.tp * self.spp * self.kvp


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    """Paged KV memory, per KVP group.

    Attributes:
        block_size: tokens per KV block.
        num_blocks_per_group: blocks in each KVP group's pool.
        max_tokens_per_group: most tokens of one request a single group holds
            (``Gmax``); a longer request spreads over up to ``kvp`` groups.
            ``None`` means one group's whole pool. Must be a multiple of
            ``block_size``.
        watermark: fraction of each group's blocks an admission must leave
            free, as head-room for decodes to grow.
        enable_prefix_caching: share the KV blocks of prompt prefixes
            computed before (see :mod:`medha_sched.kv_memory`); off by
            default here, on by default in the runtime.
        block_ids: name every block (the default), as an executor needs to
            address the KV and the prefix cache to share it. ``False``: each
            group's blocks are only counted (:mod:`medha_sched.block_counter`),
            every block id is ``-1`` and allocating or freeing any number of
            blocks costs O(1); the scheduler's decisions are the same, since
            without shared prefixes they depend only on free counts. For a
            simulator. With prefix caching on, requests that carry prefix
            content (prompt token ids or a prefix id) are then refused.
    """

    block_size: int = 16
    num_blocks_per_group: int = 4096
    max_tokens_per_group: int | None = None
    watermark: float = 0.01
    enable_prefix_caching: bool = False
    block_ids: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("num_blocks_per_group", self.num_blocks_per_group, minimum=1)
        if self.max_tokens_per_group is not None:
            _check_int("max_tokens_per_group", self.max_tokens_per_group, minimum=1)
            if self.max_tokens_per_group % self.block_size:
                raise ValueError(
                    f"max_tokens_per_group={self.max_tokens_per_group} must be a multiple "
                    f"of block_size={self.block_size}"
                )
            if self.max_tokens_per_group > self.num_blocks_per_group * self.block_size:
                raise ValueError(
                    f"max_tokens_per_group={self.max_tokens_per_group} exceeds one group's "
                    f"capacity of {self.num_blocks_per_group * self.block_size} tokens"
                )
        _check_float("watermark", self.watermark, minimum=0.0)
        if self.watermark >= 1.0:
            raise ValueError(f"watermark must be < 1, got {self.watermark!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )
        if not isinstance(self.block_ids, bool):
            raise ValueError(f"block_ids must be True or False, got {self.block_ids!r}")

    @property
    def group_token_limit(self) -> int:
        """Tokens of one request that one group holds (``Gmax``)."""
        if self.max_tokens_per_group is not None:
            return self.max_tokens_per_group
        return self.num_blocks_per_group * self.block_size

    @property
    def watermark_blocks(self) -> int:
        return math.ceil(self.watermark * self.num_blocks_per_group)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """How batches are formed.

    Attributes:
        policy: name in the policy registry (``fcfs``, ``edf``, ``lrs``,
            ``lars``, ``lars-mp``, ``srpt``).
        target_batch_time: the iteration-time budget T in seconds.
        chunk_size: ``None`` for adaptive chunking against T; a positive
            number for a fixed per-batch token budget (Sarathi-style); ``0``
            for no chunking (whole prompts, non-preemptive prefill).
        token_grid: chunk sizes are multiples of this (except a request's
            final piece).
        max_chunk_tokens: the largest chunk ever formed.
        max_batch_requests: most requests in one batch.
        long_prefill_threshold: a prompt this long or longer is a "long"
            prefill: at most one per KVP group per batch.
        max_space_share: rho_max, the most of T a long prefill yields.
        deadline_multiplier: m in D = max(m * p, min_deadline).
        min_deadline: floor of the derived TTFT deadline, seconds.
        max_consecutive_skips: prefill candidates passed over in a row before
            the packer stops looking (bounds the work of one decision).
        cache_aware_slack: with prefix caching, price a request's prefill
            work (its deadline, LARS slack, SRPT) by its uncached tokens;
            False prices it by prompt length (the baseline peers use).
        async_decodes: issue a running request's next decode while its
            previous one is still in flight (once that batch cleared stage 0),
            at most one ahead; the chunk's token id is
            :data:`~medha_sched.output.PENDING_TOKEN` (the token the previous
            batch samples). For an executor that runs batches in order on
            every rank and fills that token in (the runtime's
            ``async_scheduling``); off by default. See docs/scheduling.md.
    """

    policy: str = "lars"
    target_batch_time: float = 0.05
    chunk_size: int | None = None
    token_grid: int = 32
    max_chunk_tokens: int = 8192
    max_batch_requests: int = 512
    long_prefill_threshold: int = 32768
    max_space_share: float = 0.5
    deadline_multiplier: float = 1.5
    min_deadline: float = 0.5
    max_consecutive_skips: int = 16
    cache_aware_slack: bool = True
    async_decodes: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"policy must be a non-empty string, got {self.policy!r}")
        _check_float("target_batch_time", self.target_batch_time, minimum=0.0, strict=True)
        if self.chunk_size is not None:
            _check_int("chunk_size", self.chunk_size, minimum=0)
        _check_int("token_grid", self.token_grid, minimum=1)
        _check_int("max_chunk_tokens", self.max_chunk_tokens, minimum=1)
        if self.max_chunk_tokens < self.token_grid:
            raise ValueError(
                f"max_chunk_tokens={self.max_chunk_tokens} is below token_grid={self.token_grid}"
            )
        _check_int("max_batch_requests", self.max_batch_requests, minimum=1)
        _check_int("long_prefill_threshold", self.long_prefill_threshold, minimum=1)
        _check_float("max_space_share", self.max_space_share, minimum=0.0)
        if self.max_space_share >= 1.0:
            raise ValueError(f"max_space_share must be < 1, got {self.max_space_share!r}")
        _check_float("deadline_multiplier", self.deadline_multiplier, minimum=0.0, strict=True)
        _check_float("min_deadline", self.min_deadline, minimum=0.0)
        _check_int("max_consecutive_skips", self.max_consecutive_skips, minimum=1)
        if not isinstance(self.cache_aware_slack, bool):
            raise ValueError(
                f"cache_aware_slack must be True or False, got {self.cache_aware_slack!r}"
            )
        if not isinstance(self.async_decodes, bool):
            raise ValueError(f"async_decodes must be True or False, got {self.async_decodes!r}")

    @property
    def adaptive(self) -> bool:
        """True when chunks are sized against the time budget."""
        return self.chunk_size is None
