"""The simulator counts KV blocks instead of naming them (``CacheConfig.block_ids=False``)
unless the prefix cache may share some, with the same results as named blocks."""

from __future__ import annotations

import random

import pytest

from medha_sched.block_counter import BlockCounter
from medha_sched.block_pool import BlockPool
from medha_sched.sim import TraceRequest, engine
from medha_sched.sim.engine import Simulator

from .same import assert_same_results, paper_spec


def pools_of(spec, trace) -> set[type]:
    config, model, cache = spec.build()
    sim = Simulator(config, model, cache=cache)
    sim.run(trace)
    return {type(p) for p in sim.sched.memory._pools}


def test_blocks_are_named_only_where_a_prefix_may_be_shared() -> None:
    plain = [TraceRequest(f"r{i}", 0.1 * i, 500, 4) for i in range(4)]
    shared = [*plain, TraceRequest("p", 0.5, 600, 4, prefix_id="doc", prefix_tokens=320)]
    assert pools_of(paper_spec(), plain) == {BlockCounter}
    assert pools_of(paper_spec(), shared) == {BlockPool}
    assert pools_of(paper_spec(prefix_caching=False), shared) == {BlockCounter}


def decode_heavy_trace(seed: int) -> list[TraceRequest]:
    """Many decodes growing into tight memory (preemptions), and three long prompts."""
    rng = random.Random(seed)
    out = [
        TraceRequest(f"d{i:03d}", rng.uniform(0, 2), rng.randint(200, 3000), rng.randint(100, 900))
        for i in range(120)
    ]
    out += [
        TraceRequest(f"L{i}", rng.uniform(0, 2), rng.randint(40_000, 60_000), 20) for i in range(3)
    ]
    return sorted(out, key=lambda r: (r.arrival_s, r.id))


@pytest.mark.parametrize(("kvp", "kv_tokens", "gmax"), [(1, 150_000, None), (2, 80_000, 65_536)])
def test_counted_blocks_give_the_named_blocks_results(monkeypatch, kvp, kv_tokens, gmax) -> None:
    trace = decode_heavy_trace(seed=3)
    spec = paper_spec(kvp=kvp, kv_cache_tokens=kv_tokens, max_tokens_per_group=gmax)
    config, model, cache = spec.build()
    counted = Simulator(config, model, cache=cache).run(trace)
    monkeypatch.setattr(engine, "_counted", lambda cache, trace: cache)  # ids kept
    named_sim = Simulator(config, model, cache=cache)
    named = named_sim.run(trace)
    assert {type(p) for p in named_sim.sched.memory._pools} == {BlockPool}
    assert_same_results(counted, named)
    assert sum(r.preemptions for r in named.records) > 0  # memory ran short: growth refused
