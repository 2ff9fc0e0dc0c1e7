"""Benchmark workloads as lengths: the simulator's traces, random lengths, the short/long mix.

Every loader returns :class:`BenchRequest` objects; prompts are built from
them later (:mod:`medha_runtime.bench.prompts`). ShareGPT lives in
:mod:`medha_runtime.bench.sharegpt`.

``mixed`` draws from :func:`medha_sched.sim.workload.generate`: ShareGPT4-fitted
short requests and Medha-SWE long ones (128K-1M token prompts). A small model
cannot take those lengths, so ``max_prompt_tokens`` compresses every prompt
length on a log scale, ``x -> round(x ** a)`` with ``a = ln(P) / ln(1M)``: the
longest possible prompt becomes ``P``, order is kept and short and long stay
apart (for ``P = 96``: short median 1730 -> 12, long 128K-1M -> 48-96).
Output lengths are clipped to ``max_output_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from medha_sched.sim.trace import read_trace
from medha_sched.sim.workload import DEFAULT_MAX_CONTEXT, SHORT_CAP_TOKENS, WorkloadSpec, generate


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, line or field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchRequest:
    """One request to send, by length.

    Attributes:
        id: request id (unique in the run).
        prompt_tokens: prompt length in tokens.
        output_tokens: tokens to generate (``max_tokens``).
        arrival_s: the dataset's own arrival time, or ``None``.
        text: the prompt text, when the dataset has one (ShareGPT).
        text_ids: ``text`` encoded (special tokens included), when the loader
            already had to encode it; saves encoding it again.
        ttft_slo_s, tpot_slo_s, priority: per-request SLOs and priority (traces).
    """

    id: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    text: str | None = None
    text_ids: tuple[int, ...] | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"request {self.id!r}: {name} must be >= 1, got {value!r}")


def load_trace(
    path: str,
    *,
    num_prompts: int | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[BenchRequest]:
    """The simulator's JSONL trace (see :mod:`medha_sched.sim.trace`), in arrival order."""
    rows = sorted(read_trace(path), key=lambda r: r.arrival_s)
    if not rows:
        raise DatasetError(f"{path}: the trace has no requests")
    out = [
        BenchRequest(
            id=r.id,
            prompt_tokens=_clip(r.prompt_tokens, max_prompt_tokens),
            output_tokens=_clip(r.output_tokens, max_output_tokens),
            arrival_s=r.arrival_s,
            ttft_slo_s=r.ttft_slo_s,
            tpot_slo_s=r.tpot_slo_s,
            priority=r.priority,
        )
        for r in rows
    ]
    return out[:num_prompts] if num_prompts else out


def random_requests(
    num_prompts: int, *, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """Lengths uniform in ``[len * (1 - ratio), len * (1 + ratio)]`` (at least 1)."""
    rng = np.random.default_rng(seed)
    prompts = _uniform(rng, input_len, range_ratio, num_prompts)
    outputs = _uniform(rng, output_len, range_ratio, num_prompts)
    return [
        BenchRequest(id=f"random-{i}", prompt_tokens=int(p), output_tokens=int(o))
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def _uniform(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def mixed_requests(
    num_prompts: int,
    *,
    long_fraction: float,
    seed: int,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[BenchRequest]:
    """ShareGPT4-like short and Medha-SWE long requests (``long_fraction`` of them long)."""
    spec = WorkloadSpec(qps=1.0, num_requests=num_prompts, long_fraction=long_fraction, seed=seed)
    return [
        BenchRequest(
            id=r.id,
            prompt_tokens=compress_length(r.prompt_tokens, max_prompt_tokens),
            output_tokens=_clip(r.output_tokens, max_output_tokens),
        )
        for r in generate(spec)
    ]


def compress_length(length: int, ceiling: int | None) -> int:
    """``length ** (ln ceiling / ln 1M)``, rounded (``length`` itself without a ceiling)."""
    if ceiling is None or ceiling >= DEFAULT_MAX_CONTEXT:
        return length
    exponent = math.log(ceiling) / math.log(DEFAULT_MAX_CONTEXT)
    return max(1, min(ceiling, round(length**exponent)))


def default_long_threshold(dataset_name: str, max_prompt_tokens: int | None) -> int:
    """Prompts above this are "long": ShareGPT's 8K cap (compressed like ``mixed`` lengths)."""
    if dataset_name == "mixed":
        return compress_length(SHORT_CAP_TOKENS, max_prompt_tokens)
    return SHORT_CAP_TOKENS


def _clip(value: int, cap: int | None) -> int:
    return value if cap is None else min(value, cap)
