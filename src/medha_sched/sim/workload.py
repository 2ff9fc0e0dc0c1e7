"""Synthetic workloads: arrival processes and request-length distributions.

Lengths are lognormal, fitted exactly to a published median (P50) and 90th
percentile (P90): ``mu = ln P50`` and ``sigma = (ln P90 - ln P50) / z90``
with ``z90 = 1.2816`` the standard normal's 90th percentile. Prompt and
output lengths are drawn independently (the sources give no correlation).
Clipping only moves mass at the tails, so the P50 and P90 of the samples
stay on target as long as both lie inside the clip range.

Short requests: ShareGPT4 (``openchat_sharegpt4``, real GPT-4
conversations), capped at 8K tokens. We cannot download the trace; the fit
uses the summary statistics of that 8K-filtered trace as published in the
Sarathi-Serve paper (Agrawal et al., OSDI 2024, Table 2, the trace the Medha
paper also uses) and repeated in QoServe's Table 2: prompt P50 1730, P90
5696 tokens; output P50 415, P90 834 tokens (the Medha paper quotes the 415
median). The output is clipped to ``[1, cap - 1]`` and the prompt to
``[1, cap - output]`` so that prompt + output <= 8192.

Long requests: Medha-SWE (Medha paper, section 6): prefill P50 393K and
P90 839K tokens, decode P50 518 and P90 808 tokens (K = 1000). Prompts are
clipped to ``[min_prompt, max_context - output]``; the defaults 128K and 1M
(2**17 and 2**20 tokens) follow the paper's capacity experiment ("5%
long-context requests (128K-1M tokens)"). About 3% of draws fall below 128K
and 5% above 1M; both are clipped, not redrawn, so P50/P90 are unchanged.

Arrivals: Poisson (exponential gaps) or gamma bursts: gamma-distributed
gaps with mean ``1/qps`` and coefficient of variation ``cv`` (shape
``1/cv**2``); ``cv = 1`` is Poisson, larger is burstier.

Everything is seeded: the same arguments give the same trace. Arrival
times, the long/short choice and each length distribution draw from
independent streams, so changing the long fraction keeps the arrival times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from medha_sched.sim.trace import TraceRequest

#: standard normal quantile at 0.9
Z90 = 1.2815515655446004


@dataclass(frozen=True, kw_only=True, slots=True)
class LogNormalLengths:
    """A token-length distribution: lognormal from P50/P90, rounded and clipped.

    Attributes:
        p50: median length in tokens.
        p90: 90th-percentile length in tokens (> p50).
        source: where the two numbers come from.
    """

    p50: float
    p90: float
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.p50 > 0 and self.p90 > self.p50):
            raise ValueError(f"need 0 < p50 < p90, got p50={self.p50!r}, p90={self.p90!r}")

    @property
    def mu(self) -> float:
        return math.log(self.p50)

    @property
    def sigma(self) -> float:
        return (math.log(self.p90) - math.log(self.p50)) / Z90

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` unclipped lengths as int64 (rounded, at least 1)."""
        x = np.rint(rng.lognormal(self.mu, self.sigma, size=n))
        return np.maximum(x, 1).astype(np.int64)


#: ShareGPT4 prompts, 8K-filtered (Sarathi-Serve, OSDI 2024, Table 2)
SHAREGPT4_PROMPT = LogNormalLengths(p50=1730, p90=5696, source="Sarathi-Serve Table 2")
#: ShareGPT4 outputs, 8K-filtered (Sarathi-Serve, OSDI 2024, Table 2)
SHAREGPT4_OUTPUT = LogNormalLengths(p50=415, p90=834, source="Sarathi-Serve Table 2")
#: Medha-SWE prefills (Medha paper, section 6)
MEDHA_SWE_PROMPT = LogNormalLengths(p50=393_000, p90=839_000, source="Medha paper §6")
#: Medha-SWE decodes (Medha paper, section 6)
MEDHA_SWE_OUTPUT = LogNormalLengths(p50=518, p90=808, source="Medha paper §6")

#: ShareGPT4 trace cap: prompt + output tokens
SHORT_CAP_TOKENS = 8192
#: smallest long prompt (the paper's 128K)
LONG_MIN_PROMPT_TOKENS = 1 << 17
#: default longest long request, prompt + output (the paper's 1M)
DEFAULT_MAX_CONTEXT = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """What ``generate`` draws.

    Attributes:
        qps: mean arrival rate, requests per second.
        duration_s: arrivals in ``[0, duration_s)``; or ``None`` with ``num_requests``.
        num_requests: exactly this many requests; or ``None`` with ``duration_s``.
        long_fraction: probability that a request is long (Medha-SWE).
        seed: random seed.
        arrival: ``"poisson"`` or ``"gamma"``.
        cv: coefficient of variation of gamma gaps (ignored for Poisson).
        max_context: longest long request, prompt + output tokens.
        long_min_prompt: shortest long prompt.
        short_cap: longest short request, prompt + output tokens.
    """

    qps: float
    duration_s: float | None = None
    num_requests: int | None = None
    long_fraction: float = 0.05
    seed: int = 0
    arrival: str = "poisson"
    cv: float = 1.0
    max_context: int = DEFAULT_MAX_CONTEXT
    long_min_prompt: int = LONG_MIN_PROMPT_TOKENS
    short_cap: int = SHORT_CAP_TOKENS

    def __post_init__(self) -> None:
        if not (_finite(self.qps) and self.qps > 0):
            raise ValueError(f"qps must be a finite number > 0, got {self.qps!r}")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of duration_s and num_requests")
        if self.duration_s is not None and not (_finite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be a finite number > 0, got {self.duration_s!r}")
        if self.num_requests is not None and (
            not isinstance(self.num_requests, int) or self.num_requests < 1
        ):
            raise ValueError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        if not (_finite(self.long_fraction) and 0.0 <= self.long_fraction <= 1.0):
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival must be 'poisson' or 'gamma', got {self.arrival!r}")
        if not (_finite(self.cv) and self.cv > 0):
            raise ValueError(f"cv must be a finite number > 0, got {self.cv!r}")
        if self.short_cap < 2:
            raise ValueError(f"short_cap must be >= 2, got {self.short_cap!r}")
        if self.max_context < self.long_min_prompt + 1:
            raise ValueError(
                f"max_context={self.max_context} leaves no room above "
                f"long_min_prompt={self.long_min_prompt}"
            )


def arrival_times(
    rng: np.random.Generator,
    qps: float,
    *,
    duration_s: float | None = None,
    num_requests: int | None = None,
    arrival: str = "poisson",
    cv: float = 1.0,
) -> np.ndarray:
    """Arrival times (seconds, increasing, first gap included) of a renewal process."""
    shape = 1.0 if arrival == "poisson" else 1.0 / (cv * cv)
    mean_gap = 1.0 / qps

    def gaps(n: int) -> np.ndarray:
        if arrival == "poisson":
            return rng.exponential(mean_gap, size=n)
        return rng.gamma(shape, mean_gap / shape, size=n)

    if num_requests is not None:
        return np.cumsum(gaps(num_requests))
    assert duration_s is not None
    times = np.empty(0)
    start = 0.0
    block = max(16, int(duration_s * qps * 1.2) + 16)
    while start < duration_s:
        t = start + np.cumsum(gaps(block))
        times = np.concatenate([times, t])
        start = float(t[-1])
    return times[times < duration_s]


class WorkloadTooLarge(ValueError):
    """A workload whose arrivals do not fit in memory (numpy cannot draw them)."""


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """A mixed short/long trace, deterministic in ``spec``.

    Raises:
        WorkloadTooLarge: the arrivals do not fit in memory (``--duration 1e12``).
    """
    arrivals_ss, mix_ss, short_ss, long_ss = np.random.SeedSequence(spec.seed).spawn(4)
    try:
        times = arrival_times(
            np.random.default_rng(arrivals_ss),
            spec.qps,
            duration_s=spec.duration_s,
            num_requests=spec.num_requests,
            arrival=spec.arrival,
            cv=spec.cv,
        )
    except (MemoryError, ValueError) as exc:  # numpy: too many draws for an array
        span = (
            f"{spec.num_requests} requests"
            if spec.duration_s is None
            else f"{spec.qps:g} QPS over {spec.duration_s:g} s"
        )
        raise WorkloadTooLarge(
            f"cannot draw the arrivals of {span} ({type(exc).__name__}: {exc}); "
            "make the workload smaller"
        ) from None
    n = len(times)
    is_long = np.random.default_rng(mix_ss).random(n) < spec.long_fraction
    short_p, short_o = short_lengths(np.random.default_rng(short_ss), n, cap=spec.short_cap)
    long_p, long_o = long_lengths(
        np.random.default_rng(long_ss),
        n,
        max_context=spec.max_context,
        min_prompt=spec.long_min_prompt,
    )
    prompts = np.where(is_long, long_p, short_p)
    outputs = np.where(is_long, long_o, short_o)
    width = len(str(max(n - 1, 0)))
    return [
        TraceRequest(
            id=f"r{i:0{width}d}",
            arrival_s=round(float(times[i]), 6),
            prompt_tokens=int(prompts[i]),
            output_tokens=int(outputs[i]),
        )
        for i in range(n)
    ]


def short_lengths(rng: np.random.Generator, n: int, *, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """ShareGPT4-like (prompt, output) lengths with prompt + output <= ``cap``."""
    outputs = np.minimum(SHAREGPT4_OUTPUT.sample(rng, n), cap - 1)
    prompts = np.minimum(SHAREGPT4_PROMPT.sample(rng, n), cap - outputs)
    return prompts, outputs


def long_lengths(
    rng: np.random.Generator, n: int, *, max_context: int, min_prompt: int
) -> tuple[np.ndarray, np.ndarray]:
    """Medha-SWE-like (prompt, output) lengths, prompt in ``[min_prompt, max_context - output]``."""
    outputs = np.minimum(MEDHA_SWE_OUTPUT.sample(rng, n), max_context - min_prompt)
    prompts = np.clip(MEDHA_SWE_PROMPT.sample(rng, n), min_prompt, max_context - outputs)
    return prompts, outputs


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionSpec:
    """Multi-turn sessions over long documents: what ``generate_sessions`` draws.

    Session ``i`` opens at a Poisson arrival (rate ``qps``) with a prompt of
    its document plus a question; each later turn arrives an exponential
    think time after the previous one and resends everything so far (the
    document, every question and answer) plus a new question. Every turn's
    whole prompt lies on the session's token stream (``prefix_id`` =
    session id, ``prefix_tokens`` = the prompt), so a turn can reuse the KV
    of the previous turn's prompt; the previous answer and the new question
    are new work.

    Attributes:
        num_sessions: sessions to open.
        turns: turns per session.
        qps: session openings per second.
        doc_tokens: document length; ``None`` draws Medha-SWE prompt lengths.
        question_tokens: tokens each turn adds to the prompt.
        output_tokens: answer length; ``None`` draws ShareGPT4 output lengths.
        think_s: mean seconds between a session's turns.
        max_context: longest request, prompt + output tokens (later turns
            are dropped once a session would exceed it; a ``doc_tokens`` whose
            first turn cannot fit is refused).
        seed: random seed.
    """

    num_sessions: int
    turns: int
    qps: float
    doc_tokens: int | None = None
    question_tokens: int = 64
    output_tokens: int | None = None
    think_s: float = 30.0
    max_context: int = DEFAULT_MAX_CONTEXT
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sessions", "turns", "question_tokens", "max_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("doc_tokens", "output_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not (_finite(self.qps) and self.qps > 0):
            raise ValueError(f"qps must be a finite number > 0, got {self.qps!r}")
        if not (_finite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"think_s must be a finite number >= 0, got {self.think_s!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.doc_tokens is not None:  # not even a first turn would fit: an empty trace
            first = self.doc_tokens + self.question_tokens + (self.output_tokens or 1)
            if first > self.max_context:
                raise ValueError(
                    f"a first turn of doc_tokens={self.doc_tokens} + question_tokens="
                    f"{self.question_tokens} + {self.output_tokens or 1} output tokens exceeds "
                    f"max_context={self.max_context}: no session would have a turn"
                )


def generate_sessions(spec: SessionSpec, *, id_prefix: str = "s") -> list[TraceRequest]:
    """Every turn of every session, in arrival order (deterministic in ``spec``)."""
    starts_ss, docs_ss, outs_ss, think_ss = np.random.SeedSequence(spec.seed).spawn(4)
    starts = arrival_times(
        np.random.default_rng(starts_ss), spec.qps, num_requests=spec.num_sessions
    )
    n, k = spec.num_sessions, spec.turns
    if spec.doc_tokens is None:
        docs = MEDHA_SWE_PROMPT.sample(np.random.default_rng(docs_ss), n)
    else:
        docs = np.full(n, spec.doc_tokens, dtype=np.int64)
    if spec.output_tokens is None:
        outs = SHAREGPT4_OUTPUT.sample(np.random.default_rng(outs_ss), n * k).reshape(n, k)
    else:
        outs = np.full((n, k), spec.output_tokens, dtype=np.int64)
    gaps = np.random.default_rng(think_ss).exponential(spec.think_s, size=(n, k))
    width = len(str(max(n - 1, 0)))
    out: list[TraceRequest] = []
    for i in range(n):
        sid = f"{id_prefix}{i:0{width}d}"
        t, prompt = float(starts[i]), int(docs[i]) + spec.question_tokens
        for turn in range(k):
            output = int(outs[i, turn])
            if prompt + output > spec.max_context:
                break
            out.append(
                TraceRequest(
                    id=f"{sid}t{turn}",
                    arrival_s=round(t, 6),
                    prompt_tokens=prompt,
                    output_tokens=output,
                    prefix_id=sid,
                    prefix_tokens=prompt,
                )
            )
            t += float(gaps[i, turn])
            prompt += output + spec.question_tokens
    out.sort(key=lambda r: (r.arrival_s, r.id))
    return out
