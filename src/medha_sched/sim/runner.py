"""One simulation run described by CLI-style options, with its outputs on disk.

:class:`RunSpec` holds what ``medha-sim run`` takes; ``build()`` turns it
into a scheduler config, a cost model and a KV cache config, and every
invalid value raises :class:`OptionError` naming the flag it came from.
:func:`run_to_dir` simulates a trace and writes ``requests.jsonl`` and
``summary.json`` (and, on request, ``iterations.csv``).

KV memory is given in tokens per KVP group (``--kv-cache-tokens``). The
default, 8M tokens, is roughly what Llama-3-8B leaves for KV on 16
A100-80GB GPUs as TP8 x SPP2 (8 KiB of KV per token per GPU, about 70 GB
free per GPU); set it for your own model and hardware.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from medha_sched.config import CacheConfig, ParallelDegrees, SchedulerConfig
from medha_sched.cost.base import CostModel
from medha_sched.cost.registry import parse_cost_model_spec
from medha_sched.policies import available_policies
from medha_sched.sim.defaults import DEFAULT_COST_MODEL as DEFAULT_COST_MODEL
from medha_sched.sim.defaults import DEFAULT_KV_CACHE_TOKENS as DEFAULT_KV_CACHE_TOKENS
from medha_sched.sim.defaults import DEFAULT_TARGET_BATCH_TIME as DEFAULT_TARGET_BATCH_TIME
from medha_sched.sim.engine import SimResult, simulate
from medha_sched.sim.metrics import summarize, write_iterations, write_requests
from medha_sched.sim.trace import TraceRequest

T = TypeVar("T")

# SchedulerConfig / CacheConfig / ParallelDegrees field -> the flag that sets it
_FLAGS = {
    "policy": "--policy",
    "target_batch_time": "--target-batch-time",
    "chunk_size": "--chunk-size",
    "long_prefill_threshold": "--long-threshold",
    "block_size": "--block-size",
    "num_blocks_per_group": "--kv-cache-tokens",
    "max_tokens_per_group": "--max-tokens-per-group",
    "tp": "--tp",
    "spp": "--spp",
    "kvp": "--kvp",
}


class OptionError(ValueError):
    """An invalid option; the message names the flag and the value."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """Everything that configures one replica (the ``medha-sim run`` options).

    Attributes:
        policy: scheduling policy name.
        cost_model: cost-model spec string (``affine:...``, ``roofline:...``, ``table:PATH``).
        target_batch_time: iteration budget T, seconds.
        chunk_size: ``None`` adaptive; ``N > 0`` fixed chunks; ``0`` no chunking.
        tp, spp, kvp: parallel degrees (passed to the cost model).
        kv_cache_tokens: KV capacity of each KVP group, tokens.
        max_tokens_per_group: tokens of one request per KVP group (Gmax), or
            ``None`` for a whole group.
        long_threshold: prompts this long are "long" (scheduler and metrics).
        block_size: tokens per KV block.
        admission_delay_s: seconds from a request's arrival until the scheduler
            sees it (see :class:`~medha_sched.sim.engine.Simulator`).
        prefix_caching: reuse the KV of shared prefixes (trace ``prefix_id``).
        slack: ``"cache-aware"`` prices a prefill by its uncached tokens,
            ``"length"`` by its prompt length (deadlines, LARS, SRPT).
    """

    policy: str = "lars-mp"
    cost_model: str = DEFAULT_COST_MODEL
    target_batch_time: float = DEFAULT_TARGET_BATCH_TIME
    chunk_size: int | None = None
    tp: int = 1
    spp: int = 1
    kvp: int = 1
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    max_tokens_per_group: int | None = None
    long_threshold: int = 32768
    block_size: int = 16
    admission_delay_s: float = 0.0
    prefix_caching: bool = True
    slack: str = "cache-aware"

    def build(self) -> tuple[SchedulerConfig, CostModel, CacheConfig]:
        """The scheduler config, cost model and cache; raises :class:`OptionError`."""
        if self.policy not in available_policies():
            known = ", ".join(available_policies())
            raise OptionError(f"--policy {self.policy!r} is not a policy; known: {known}")
        delay = self.admission_delay_s
        if not isinstance(delay, int | float) or not 0.0 <= delay < float("inf"):
            raise OptionError(f"--admission-delay must be a finite number >= 0, got {delay!r}")
        layout = _checked(ParallelDegrees, tp=self.tp, spp=self.spp, kvp=self.kvp)
        try:
            model = parse_cost_model_spec(self.cost_model, layout=layout)
        except ValueError as exc:
            raise OptionError(f"--cost-model {self.cost_model!r}: {exc}") from None
        config = _checked(
            SchedulerConfig,
            policy=self.policy,
            target_batch_time=self.target_batch_time,
            chunk_size=self.chunk_size,
            long_prefill_threshold=self.long_threshold,
            cache_aware_slack=self._cache_aware_slack(),
        )
        if not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < self.block_size:
            raise OptionError(
                f"--kv-cache-tokens must be an integer >= the block size ({self.block_size}), "
                f"got {self.kv_cache_tokens!r}"
            )
        cache = _checked(
            CacheConfig,
            block_size=self.block_size,
            num_blocks_per_group=self.kv_cache_tokens // self.block_size,
            max_tokens_per_group=self.max_tokens_per_group,
            enable_prefix_caching=self.prefix_caching,
        )
        return config, model, cache

    def _cache_aware_slack(self) -> bool:
        if self.slack not in ("cache-aware", "length"):
            raise OptionError(f"--slack must be 'cache-aware' or 'length', got {self.slack!r}")
        return self.slack == "cache-aware"

    @property
    def label(self) -> str:
        """``policy`` plus its chunking, e.g. ``fcfs@512``, ``fcfs@0``, ``lars``."""
        return self.policy if self.chunk_size is None else f"{self.policy}@{self.chunk_size}"

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "label": self.label}


def _checked(cls: type[T], **kwargs: object) -> T:
    try:
        return cls(**kwargs)
    except ValueError as exc:
        msg = str(exc)
        flag = _FLAGS.get(re.match(r"\w*", msg).group())  # messages start with the field
        raise OptionError(f"{flag}: {msg}" if flag else msg) from None


def run_to_dir(
    trace: Sequence[TraceRequest],
    spec: RunSpec,
    out_dir: str | Path,
    *,
    progress: Callable[[int], None] | None = None,
    trace_path: str | None = None,
    iterations: bool = False,
) -> dict[str, object]:
    """Simulate ``trace`` under ``spec``; write the outputs; return the summary.

    Writes ``requests.jsonl`` and ``summary.json``, and ``iterations.csv`` when
    ``iterations`` is true.
    """
    config, model, cache = spec.build()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = simulate(
        trace,
        config,
        model,
        cache=cache,
        progress=progress,
        admission_delay_s=spec.admission_delay_s,
    )
    summary = summary_of(result, spec, trace_path=trace_path)
    t0 = time.perf_counter()
    write_requests(out / "requests.jsonl", result.records, spec.long_threshold)
    if iterations:
        write_iterations(out / "iterations.csv", result.iterations)
    summary["write_wall_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def summary_of(
    result: SimResult, spec: RunSpec, *, trace_path: str | None = None
) -> dict[str, object]:
    """``summary.json``: the run's configuration, its metrics and the wall time."""
    summary: dict[str, object] = {"run": {**spec.to_json(), "trace": trace_path}}
    summary.update(
        summarize(
            result.records,
            result.iterations,
            long_threshold=spec.long_threshold,
            num_stages=spec.spp,
        )
    )
    queries, hits = result.prefix_cache_queries, result.prefix_cache_hits
    summary["prefix_cache"] = {
        "query_tokens": queries,
        "hit_tokens": hits,
        "hit_rate": hits / queries if queries else None,
    }
    summary["simulated_s"] = result.end_s
    summary["sim_wall_s"] = result.wall_s
    return summary
