"""Decode runs (``Simulator(decode_runs=True)``, the default) change no result.

A run plans and applies many decode-only iterations at once; the simulation
must give the same per-request records and the same per-iteration records
as going one batch at a time, under every policy, with pipelining, KVP
shards and KV memory tight enough to force preemptions.
"""

from __future__ import annotations

import dataclasses

import pytest

from medha_sched import AffineCostModel, CacheConfig, ParallelDegrees, SchedulerConfig
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler
from medha_sched.sim import TraceRequest, simulate
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate


def both(trace, config, model, cache):
    off = simulate(trace, config, model, cache=cache, decode_runs=False)
    on = simulate(trace, config, model, cache=cache, decode_runs=True)
    return off, on


def assert_same(off, on) -> None:
    assert [dataclasses.astuple(r) for r in on.records] == [
        dataclasses.astuple(r) for r in off.records
    ]
    assert on.iterations == off.iterations
    assert on.end_s == off.end_s


@pytest.mark.parametrize(
    ("policy", "chunk", "tp", "spp", "kvp"),
    [
        ("lars-mp", None, 8, 2, 1),
        ("lars", None, 8, 1, 1),
        ("fcfs", 512, 8, 2, 1),
        ("fcfs", 0, 8, 1, 1),
        ("edf", None, 4, 2, 2),
        ("lrs", None, 8, 3, 1),
    ],
)
def test_paper_setting_same_results(policy, chunk, tp, spp, kvp) -> None:
    trace = generate(WorkloadSpec(qps=1.0, num_requests=60, long_fraction=0.05, seed=3))
    spec = RunSpec(policy=policy, chunk_size=chunk, tp=tp, spp=spp, kvp=kvp)
    off, on = both(trace, *spec.build())
    assert_same(off, on)
    decode_only = sum(1 for it in off.iterations if it.prefill_chunks == 0)
    assert decode_only > len(off.iterations) // 3  # runs had something to take


def test_tight_memory_preemptions_and_shards_same_results() -> None:
    trace = [TraceRequest(f"r{i}", 0.02 * i, 300 + 37 * i, 40 + 11 * i) for i in range(24)]
    config = SchedulerConfig(policy="lars-mp", target_batch_time=0.05)
    model = AffineCostModel(
        base=0.004, per_token=2e-5, per_attn=1e-8, layout=ParallelDegrees(kvp=2)
    )
    cache = CacheConfig(block_size=16, num_blocks_per_group=96, max_tokens_per_group=512)
    off, on = both(trace, config, model, cache)
    assert_same(off, on)
    assert sum(r.preemptions for r in off.records) > 0  # the memory really was tight


def make_scheduler() -> Scheduler:
    model = AffineCostModel(base=0.01, per_token=1e-4, per_attn=0.0)
    return Scheduler(SchedulerConfig(target_batch_time=0.05), model)


def test_no_run_while_a_prompt_waits_or_a_batch_is_in_flight() -> None:
    s = make_scheduler()
    s.add_request(Request("a", 0.0, 10, 5))
    assert s.plan_decode_run(8) == []  # the prompt waits
    out = s.schedule(0.0)
    assert s.plan_decode_run(8) == []  # its prefill is in flight
    s.on_batch_end(out.batch_id, _result(out))
    times = s.plan_decode_run(8)
    # 5 output tokens: the prefill sampled one, a run may not take the last
    assert len(times) == 3 and all(t > 0 for t in times)
    ids = s.commit_decode_run([0.1, 0.2, 0.3])
    assert list(ids) == [out.batch_id + 1, out.batch_id + 2, out.batch_id + 3]
    r = s.get_request("a")
    assert r.num_output_tokens == 4 and r.num_computed_tokens == 13
    assert s.plan_decode_run(8) == []  # the next token is the last one
    with pytest.raises(ValueError, match="backwards"):
        s.commit_decode_run([0.05])


def _result(out):
    from medha_sched.output import BatchResult

    return BatchResult(sampled_token_ids={c.request_id: 0 for c in out.chunks if c.samples})


@pytest.mark.parametrize(("spp", "kv_tokens"), [(2, 8_388_608), (4, 8_388_608), (2, 6000)])
def test_lane_cycles_taken_and_same_results(monkeypatch, spp, kv_tokens) -> None:
    """Lanes taking turns in the pipeline (decodes in flight) are issued in bulk."""
    trace = generate(WorkloadSpec(qps=2.0, num_requests=80, long_fraction=0.0, seed=5))
    spec = RunSpec(policy="lars-mp", tp=8, spp=spp, kv_cache_tokens=kv_tokens)
    config, model, cache = spec.build()
    turns: list[int] = []
    commit = Scheduler.commit_lane_cycle

    def counting(self, plan, n, last_start):
        turns.append(n)
        return commit(self, plan, n, last_start)

    monkeypatch.setattr(Scheduler, "commit_lane_cycle", counting)
    off, on = both(trace, config, model, cache)
    assert_same(off, on)
    assert len(turns) > 0  # cycles took batches
    if kv_tokens > 10_000:
        assert sum(turns) > len(off.iterations) // 10  # many
    else:
        assert sum(r.preemptions for r in off.records) > 0  # the memory really was tight


def test_no_lane_cycle_while_a_prompt_waits() -> None:
    s = make_scheduler()
    assert s.plan_lane_cycle(8) is None  # nothing in flight
    s.add_request(Request("a", 0.0, 10, 50))
    assert s.schedule(0.0).prefill_chunks  # a's prefill in flight
    s.add_request(Request("b", 0.0, 10, 50))
    assert s.plan_lane_cycle(8) is None  # b waits (and a's batch carries a prefill)


@pytest.mark.parametrize(("spp", "kvp"), [(2, 1), (4, 1), (2, 2)])
def test_lone_prefill_chunks_taken_and_same_results(monkeypatch, spp, kvp) -> None:
    """A long prefill running alone issues its chunks in bulk, with the same results."""
    trace = [
        TraceRequest("long", 0.0, 60_000, 4),
        TraceRequest("short", 0.5, 300, 20),
        TraceRequest("late", 9.0, 50_000, 3),
    ]
    spec = RunSpec(policy="lars-mp", tp=8, spp=spp, kvp=kvp, long_threshold=16_384)
    config, model, cache = spec.build()
    chunks: list[int] = []
    commit = Scheduler.commit_lone_prefill

    def counting(self, request, sizes, *args):
        chunks.extend(sizes)
        return commit(self, request, sizes, *args)

    monkeypatch.setattr(Scheduler, "commit_lone_prefill", counting)
    off, on = both(trace, config, model, cache)
    assert_same(off, on)
    with_prefill = [it for it in off.iterations if it.prefill_chunks]
    assert len(chunks) > len(with_prefill) // 2  # most chunks went in bulk


def test_no_lone_prefill_beside_decodes() -> None:
    s = make_scheduler()
    s.add_request(Request("a", 0.0, 10, 50))
    out = s.schedule(0.0)
    s.on_batch_end(out.batch_id, _result(out))  # a decodes now
    s.add_request(Request("b", 0.0, 10_000, 5))
    assert s.lone_prefill() is None  # b's chunks go beside a's decodes
    with pytest.raises(ValueError, match="lone-prefill"):
        s.commit_lone_prefill(s.get_request("b"), [], 0, 0, [])


@pytest.mark.parametrize(("spp", "kvp"), [(2, 1), (4, 1), (2, 2)])
def test_prefill_turns_beside_decodes_taken_and_same_results(monkeypatch, spp, kvp) -> None:
    """A long prefill's chunks beside running decodes go without whole batches."""
    trace = [TraceRequest("long", 0.0, 60_000, 4)] + [
        TraceRequest(f"s{i}", 0.2 + 0.4 * i, 200 + 50 * i, 30 + 7 * i) for i in range(12)
    ]
    spec = RunSpec(policy="lars-mp", tp=8, spp=spp, kvp=kvp, long_threshold=16_384)
    config, model, cache = spec.build()
    turns: list[int] = []
    turn = Scheduler.prefill_turn

    def counting(self, request, now):
        got = turn(self, request, now)
        if got is not None:
            turns.append(got[3])
        return got

    monkeypatch.setattr(Scheduler, "prefill_turn", counting)
    off = simulate(trace, config, model, cache=cache, decode_runs=False)
    # every turn on its own (runs of turns: tests/sim/test_turn_runs.py)
    on = simulate(trace, config, model, cache=cache, decode_runs=True, turn_runs=False)
    assert_same(off, on)
    assert len(turns) > 10 and any(d > 0 for d in turns)  # turns carried decodes too


@pytest.mark.parametrize(("spp", "qps"), [(2, 2.0), (3, 3.0)])
def test_lane_cycles_price_one_turn_past_the_fewest(monkeypatch, spp, qps) -> None:
    """``plan_lane_cycle`` prices no lane past one turn more than the lane with
    fewest: every cycle takes the same turns as with each lane's full count
    (a tighter cap, the fewest alone, would stop cycles early), fewer priced."""
    from medha_sched import scheduler as sched_mod

    trace = generate(WorkloadSpec(qps=qps, num_requests=80, long_fraction=0.0, seed=7))
    config, model, cache = RunSpec(policy="lars-mp", tp=8, spp=spp).build()
    commit, plan = Scheduler.commit_lane_cycle, Scheduler.plan_lane_cycle

    def run(cap):
        monkeypatch.setattr(sched_mod, "_round_robin_counts", cap)
        taken, priced = [], [0]

        def counting(self, p, n, last_start):
            taken.append(n)
            return commit(self, p, n, last_start)

        def planning(self, *args):
            p = plan(self, *args)
            priced[0] += 0 if p is None else sum(map(len, p.times))
            return p

        monkeypatch.setattr(Scheduler, "commit_lane_cycle", counting)
        monkeypatch.setattr(Scheduler, "plan_lane_cycle", planning)
        return simulate(trace, config, model, cache=cache), taken, priced[0]

    capped, taken, priced = run(sched_mod._round_robin_counts)
    full, taken_full, priced_full = run(list)
    assert_same(full, capped)
    assert taken == taken_full and sum(taken) > len(full.iterations) // 10
    assert priced < priced_full
