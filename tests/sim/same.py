"""Two simulations' results compared whole: the check behind every "decisions unchanged"."""

from __future__ import annotations

import dataclasses
import random

from medha_sched.sim import TraceRequest
from medha_sched.sim.engine import SimResult, Simulator
from medha_sched.sim.runner import RunSpec


def assert_same_results(a: SimResult, b: SimResult) -> None:
    """Requests' records, batches, end time and prefix-cache counters all equal."""
    assert [dataclasses.astuple(r) for r in a.records] == [
        dataclasses.astuple(r) for r in b.records
    ]
    assert a.iterations == b.iterations
    assert a.end_s == b.end_s
    assert (a.prefix_cache_queries, a.prefix_cache_hits) == (
        b.prefix_cache_queries,
        b.prefix_cache_hits,
    )


def paper_spec(**changes) -> RunSpec:
    """The paper's setting as ``benchmarks/sim_speed.py`` runs it (lars-mp, roofline
    Llama-3-8B on A100s, TP8 x SPP2, T = 50 ms), with ``changes`` (RunSpec's fields)."""
    spec = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=2,
        target_batch_time=0.05,
    )
    return dataclasses.replace(spec, **changes)


def simulate(trace, spec: RunSpec, **flags) -> SimResult:
    """``spec``'s simulator (``flags``: :class:`Simulator`'s keywords) run on ``trace``."""
    config, model, cache = spec.build()
    return Simulator(config, model, cache=cache, **flags).run(trace)


def simulate_with_skips(trace: list[TraceRequest], spec: RunSpec, skips: int, **flags) -> SimResult:
    """``simulate`` with the scheduler's ``max_consecutive_skips`` set to ``skips``."""
    config, model, cache = spec.build()
    config = dataclasses.replace(config, max_consecutive_skips=skips)
    return Simulator(config, model, cache=cache, **flags).run(trace)


def mixed_long_short_trace(seed: int, longs: int, shorts: int) -> list[TraceRequest]:
    """Long prompts arriving early and over time, short ones among them: most
    behind the long ones in the queue's order, some ahead (early deadlines)."""
    rng = random.Random(seed)
    out = [
        TraceRequest(
            f"long{i:02d}",
            rng.uniform(0.0, 0.4) if i < longs // 2 else rng.uniform(0.4, 20.0),
            rng.randint(40_000, 90_000),
            rng.randint(2, 6),
        )
        for i in range(longs)
    ]
    out += [
        TraceRequest(
            f"s{i:03d}",
            rng.uniform(0.0, 25.0),
            rng.randint(30, 3_000),
            rng.randint(2, 60),
            ttft_slo_s=rng.choice([None, 400.0, 30.0, 0.5]),
        )
        for i in range(shorts)
    ]
    return sorted(out, key=lambda r: (r.arrival_s, r.id))


#: (policy, max_consecutive_skips, spp, seed) of the mixed-trace comparisons: the
#: fast paths against the slow ones (fcfs has no turns: the scan tests add it)
MIXED_CASES = [
    ("lars-mp", 16, 2, 0),
    ("lars-mp", 4, 2, 1),
    ("lars", 3, 3, 2),
    ("edf", 6, 2, 3),
    ("lars-mp", 8, 4, 5),
]
