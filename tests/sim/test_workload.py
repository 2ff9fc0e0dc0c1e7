"""Workload generation: fitted distributions, determinism, mix and arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from medha_sched.sim.workload import (
    MEDHA_SWE_OUTPUT,
    MEDHA_SWE_PROMPT,
    SHAREGPT4_OUTPUT,
    SHAREGPT4_PROMPT,
    WorkloadSpec,
    arrival_times,
    generate,
    long_lengths,
    short_lengths,
)


def within(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * target


def test_lognormal_fit_is_exact_at_p50_and_p90() -> None:
    for dist in (SHAREGPT4_PROMPT, SHAREGPT4_OUTPUT, MEDHA_SWE_PROMPT, MEDHA_SWE_OUTPUT):
        assert math.isclose(math.exp(dist.mu), dist.p50)
        assert math.isclose(math.exp(dist.mu + 1.2815515655446004 * dist.sigma), dist.p90)


def test_long_requests_match_medha_swe_statistics() -> None:
    rng = np.random.default_rng(1)
    prompts, outputs = long_lengths(rng, 200_000, max_context=1 << 20, min_prompt=1 << 17)
    assert within(np.percentile(prompts, 50), 393_000, 0.02)
    assert within(np.percentile(prompts, 90), 839_000, 0.02)
    assert within(np.percentile(outputs, 50), 518, 0.02)
    assert within(np.percentile(outputs, 90), 808, 0.02)
    assert prompts.min() >= 1 << 17
    assert (prompts + outputs).max() <= 1 << 20


def test_short_requests_match_sharegpt4_and_respect_the_8k_cap() -> None:
    rng = np.random.default_rng(2)
    prompts, outputs = short_lengths(rng, 200_000, cap=8192)
    assert within(np.percentile(prompts, 50), 1730, 0.03)
    assert within(np.percentile(prompts, 90), 5696, 0.03)
    assert within(np.percentile(outputs, 50), 415, 0.03)
    assert within(np.percentile(outputs, 90), 834, 0.03)
    assert prompts.min() >= 1 and outputs.min() >= 1
    assert (prompts + outputs).max() <= 8192


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    spec = WorkloadSpec(qps=2.0, duration_s=200.0, long_fraction=0.2, seed=7)
    assert generate(spec) == generate(spec)
    other = generate(WorkloadSpec(qps=2.0, duration_s=200.0, long_fraction=0.2, seed=8))
    assert other != generate(spec)


def test_long_fraction_is_respected_and_keeps_arrival_times() -> None:
    base = WorkloadSpec(qps=10.0, num_requests=20_000, long_fraction=0.05, seed=3)
    trace = generate(base)
    frac = sum(r.prompt_tokens >= 1 << 17 for r in trace) / len(trace)
    assert abs(frac - 0.05) < 0.006  # ~4 standard deviations
    none = generate(WorkloadSpec(qps=10.0, num_requests=20_000, long_fraction=0.0, seed=3))
    assert all(r.prompt_tokens + r.output_tokens <= 8192 for r in none)
    assert [r.arrival_s for r in none] == [r.arrival_s for r in trace]
    everything = generate(WorkloadSpec(qps=10.0, num_requests=500, long_fraction=1.0, seed=3))
    assert all(r.prompt_tokens >= 1 << 17 for r in everything)


@pytest.mark.parametrize(("arrival", "cv"), [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_arrivals_have_the_requested_rate_and_burstiness(arrival: str, cv: float) -> None:
    rng = np.random.default_rng(4)
    times = arrival_times(rng, 4.0, num_requests=100_000, arrival=arrival, cv=cv)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps >= 0)
    assert within(gaps.mean(), 0.25, 0.03)
    assert within(gaps.std() / gaps.mean(), cv, 0.05)


def test_duration_bounds_the_arrivals() -> None:
    trace = generate(WorkloadSpec(qps=5.0, duration_s=100.0, seed=5))
    assert 400 < len(trace) < 600
    assert all(0 <= r.arrival_s < 100.0 for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert len({r.id for r in trace}) == len(trace)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"qps": 0, "duration_s": 1.0}, "qps"),
        ({"qps": 1.0}, "exactly one of duration_s and num_requests"),
        ({"qps": 1.0, "duration_s": 1.0, "num_requests": 3}, "exactly one"),
        ({"qps": 1.0, "duration_s": 1.0, "long_fraction": 1.5}, "long_fraction"),
        ({"qps": 1.0, "duration_s": 1.0, "arrival": "uniform"}, "arrival"),
        ({"qps": 1.0, "duration_s": 1.0, "cv": 0.0}, "cv"),
        ({"qps": 1.0, "duration_s": 1.0, "max_context": 1000}, "max_context"),
    ],
)
def test_bad_workload_spec_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**kwargs)
