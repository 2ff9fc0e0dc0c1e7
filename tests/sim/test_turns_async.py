"""Prefill turns (the simulator's shortcut past ``schedule()``) are not taken with
``async_decodes``: they neither issue decodes ahead nor hold them back as
``schedule()`` does in that mode. A reviewer's fuzzer found seed 1095 crashing
(``KeyError('L1')``) and 13 of 200 async configurations diverging from
``decode_runs=False``; these are a few of them."""

from __future__ import annotations

import dataclasses
import random

import pytest

from medha_sched.sim import TraceRequest, simulate
from medha_sched.sim.runner import RunSpec


def _trace(rng: random.Random, n_long: int, n_short: int) -> list[TraceRequest]:
    long = (rng.randrange(20000, 60000) for _ in range(n_long))
    out = [
        TraceRequest(f"L{i}", rng.uniform(0, 1.0), n, rng.randrange(2, 20))
        for i, n in enumerate(long)
    ]
    out += [
        TraceRequest(f"s{i}", rng.uniform(0, 6.0), rng.randrange(50, 3000), rng.randrange(5, 60))
        for i in range(n_short)
    ]
    return sorted(out, key=lambda r: r.arrival_s)


def _outcome(result) -> tuple:
    return [dataclasses.astuple(r) for r in result.records], result.iterations, result.end_s


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["lars", "lars-mp"])
def test_async_decodes_simulate_the_same_with_and_without_shortcuts(seed: int, policy: str):
    rng = random.Random(seed)
    config, model, cache = RunSpec(policy=policy, tp=8, spp=2, long_threshold=16384).build()
    config = dataclasses.replace(config, async_decodes=True)
    trace = _trace(rng, rng.randrange(3, 6), rng.randrange(0, 8))
    plain = simulate(trace, config, model, cache=cache, decode_runs=False)
    fast = simulate(trace, config, model, cache=cache, decode_runs=True)
    assert _outcome(fast) == _outcome(plain)
