"""The incremental scheduler (issue 20) decides exactly as the reference does.

``tests/sched/reference`` keeps the algorithm of issue 2, which re-reads
every running decode at every step. Both are driven in lockstep through
random workloads (pipelining, KVP shards, memory tight enough to preempt,
the batch-size cap, aborts, stop tokens, decode runs) under cost models
priced in O(1) per lane (integer features) and one by one (float features);
every batch, every finished list and every planned decode run must be
equal. The compact decode form must also rebuild every batch's decodes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha_sched import (
    AffineCostModel,
    CacheConfig,
    ParallelDegrees,
    Request,
    Scheduler,
    SchedulerConfig,
    parse_cost_model_spec,
)
from medha_sched.cost.base import AggregateCostModel
from medha_sched.decode_set import decode_line
from medha_sched.output import BatchResult, DecodeTracker, ScheduleOutput

from .models import PolyCostModel, poly_models
from .reference import ReferenceScheduler, ResortQueue
from .strategies import POLICIES


@dataclass(frozen=True, kw_only=True)
class IntPolyCostModel(PolyCostModel):
    """``PolyCostModel`` with integer features: decodes priced per lane, in O(1)."""

    affine_decode_features = True

    def features(self, q_tokens: int, kv_tokens: int, tail: bool) -> tuple[float, ...]:
        if tail:
            return (q_tokens, q_tokens * (kv_tokens + q_tokens), kv_tokens, 0)
        return (0, q_tokens * kv_tokens, kv_tokens, q_tokens)


def int_poly_models(layout: ParallelDegrees) -> st.SearchStrategy[IntPolyCostModel]:
    return poly_models(layout).map(
        lambda m: IntPolyCostModel(base=m.base, a=m.a, b=m.b, c=m.c, d=m.d, e=m.e, layout=m.layout)
    )


@st.composite
def twins(draw):
    """A scheduler and its reference twin: same config, cost model and cache."""
    layout = ParallelDegrees(spp=draw(st.integers(1, 3)), kvp=draw(st.integers(1, 3)))
    kind = draw(st.sampled_from(["int", "float", "affine", "roofline"]))
    if kind == "int":
        model = draw(int_poly_models(layout))
    elif kind == "float":
        model = draw(poly_models(layout))
    elif kind == "affine":
        model = AffineCostModel(base=2e-3, per_token=2e-5, per_attn=1e-8, layout=layout)
    else:
        model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100", layout=layout)
    block = draw(st.sampled_from([1, 4, 16]))
    tight = draw(st.booleans())
    blocks = draw(st.integers(40, 90) if tight else st.integers(400, 800))
    gmax = block * draw(st.integers(max(8, blocks // 3), blocks))
    cache = CacheConfig(
        block_size=block,
        num_blocks_per_group=blocks,
        max_tokens_per_group=gmax,
        watermark=0.01 if tight else 0.05,
    )
    adaptive = draw(st.booleans())
    config = SchedulerConfig(
        policy=draw(st.sampled_from(POLICIES)),
        target_batch_time=draw(st.floats(0.01, 0.2)),
        chunk_size=None if adaptive else draw(st.sampled_from([0, 64, 256])),
        token_grid=draw(st.sampled_from([1, 8, 32])),
        max_chunk_tokens=draw(st.sampled_from([64, 256, 2048])),
        max_batch_requests=draw(st.integers(2, 64)),
        long_prefill_threshold=draw(st.sampled_from([128, 1024])),
        min_deadline=draw(st.floats(0.01, 2.0)),
    )
    return Scheduler(config, model, cache=cache), ReferenceScheduler(config, model, cache=cache)


@st.composite
def requests(draw, sched: Scheduler):
    n = draw(st.integers(1, 14))
    cap = max(1, min(sched.max_prompt_tokens, 3000))
    spread = draw(st.sampled_from([0.01, 0.5, 2.0]))
    out = []
    for i in range(n):
        prompt = draw(st.one_of(st.integers(1, min(cap, 300)), st.integers(1, cap)))
        output = draw(st.integers(1, 80))
        if prompt > sched.max_prompt_tokens or prompt + output > sched.max_context_tokens:
            continue
        tpot = draw(st.one_of(st.none(), st.floats(0.005, 0.5)))
        ttft = draw(st.one_of(st.none(), st.floats(0.05, 5.0)))
        priority = draw(st.sampled_from([0, 0, 0, 1]))
        out.append((f"r{i}", draw(st.floats(0.0, spread)), prompt, output, ttft, tpot, priority))
    return out


def make(spec: Sequence[tuple]) -> list[Request]:
    return [
        Request(rid, t, p, o, ttft_slo=ttft, tpot_slo=tpot, priority=prio)
        for rid, t, p, o, ttft, tpot, prio in spec
    ]


def same_output(a: ScheduleOutput, b: ScheduleOutput) -> None:
    assert a.batch_id == b.batch_id and a.time == b.time
    assert a.chunks == b.chunks, f"batch {a.batch_id}: chunks differ"
    assert a.preempted == b.preempted
    assert a.predicted_time == b.predicted_time, f"batch {a.batch_id}: prices differ"
    assert a.target_time == b.target_time
    assert a.num_decodes == b.num_decodes
    assert a == b


def check_tracker(tracker: DecodeTracker, out: ScheduleOutput) -> None:
    got = tracker.decodes(out)
    want = {
        c.request_id: (c.start, c.kvp_groups, c.new_blocks) for c in out.chunks[: out.num_decodes]
    }
    assert got == want, f"batch {out.batch_id}: the compact decodes rebuild wrongly"


def lockstep(new: Scheduler, ref: ReferenceScheduler, spec, seed: int, runs: bool) -> int:
    """Drive both through ``spec``; returns the number of batches compared."""
    rng = random.Random(seed)
    pending = sorted(zip(make(spec), make(spec), strict=True), key=lambda p: p[0].arrival_time)
    tracker = DecodeTracker()
    spp = new.layout.spp
    stage_free = [0.0] * spp
    in_flight: list[tuple[float, float, int, ScheduleOutput]] = []
    now, compared, steps = 0.0, 0, 0
    while pending or new.has_unfinished_requests() or ref.has_unfinished_requests():
        steps += 1
        assert steps < 20_000, "no progress"
        while pending and pending[0][0].arrival_time <= now:
            a, b = pending.pop(0)
            new.add_request(a)
            ref.add_request(b)
        if rng.random() < 0.03:  # abort someone, in flight or not
            live = sorted(r.request_id for r in ref._requests.values())
            if live:
                victim = rng.choice(live)
                new.abort_request(victim)
                ref.abort_request(victim)
        if runs and rng.random() < 0.5:
            plan = new.plan_decode_run(8)
            assert plan == ref.plan_decode_run(8)
            if plan:
                k = rng.randint(1, len(plan))
                starts = [now + 1e-3 * i for i in range(k)]
                assert new.commit_decode_run(starts) == ref.commit_decode_run(starts)
                now = starts[-1]
        if stage_free[0] <= now:
            out = new.schedule(now)
            same_output(out, ref.schedule(now))
            check_tracker(tracker, out)
            compared += 1
            if not out.is_empty:
                s0, end = occupy(stage_free, now, out.predicted_time / spp)
                in_flight.append((s0, end, out.batch_id, out))
        events = [s0 for s0, _, _, _ in in_flight if s0 > now] + [e for _, e, _, _ in in_flight]
        if stage_free[0] > now:
            events.append(stage_free[0])
        if pending:
            events.append(pending[0][0].arrival_time)
        nxt = max(min(events), now) if events else now + 1e-3
        for s0, _, bid, _ in in_flight:
            if s0 <= nxt:
                new.on_stage_end(bid)
                ref.on_stage_end(bid)
        while in_flight and in_flight[0][1] <= nxt:
            out = in_flight.pop(0)[3]
            result = sample(out, rng)
            assert new.on_batch_end(out.batch_id, result) == ref.on_batch_end(out.batch_id, result)
        now = nxt
    new.memory.check_invariants()
    assert new.memory.usage() == 0.0
    return compared


def occupy(stage_free: list[float], now: float, stage_time: float) -> tuple[float, float]:
    t, first = now, None
    for k in range(len(stage_free)):
        t = max(t, stage_free[k]) + stage_time
        stage_free[k] = t
        first = t if first is None else first
    assert first is not None
    return first, t


def sample(out: ScheduleOutput, rng: random.Random) -> BatchResult:
    rows = [c.request_id for c in out.chunks if c.samples]
    tokens = {rid: rng.randint(1, 1000) for rid in rows}
    stopped = frozenset(rid for rid in rows if rng.random() < 0.02)
    return BatchResult(sampled_token_ids=tokens, stopped=stopped)


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_same_batches_as_the_reference(data) -> None:
    new, ref = data.draw(twins())
    spec = data.draw(requests(new))
    compared = lockstep(new, ref, spec, data.draw(st.integers(0, 1 << 30)), runs=False)
    assert compared >= 1 or not spec


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_same_decode_runs_as_the_reference(data) -> None:
    new, ref = data.draw(twins())
    spec = data.draw(requests(new))
    lockstep(new, ref, spec, data.draw(st.integers(0, 1 << 30)), runs=True)


def test_a_busy_replica_matches_step_for_step() -> None:
    """256 decodes, a queue of prompts, 16-token blocks: the benchmark's shape, small."""
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100")
    cache = CacheConfig(block_size=16, num_blocks_per_group=1 << 16)
    config = SchedulerConfig(policy="lars-mp", target_batch_time=0.05)
    new, ref = Scheduler(config, model, cache=cache), ReferenceScheduler(config, model, cache=cache)
    rng = random.Random(5)
    spec = [
        (f"d{i}", 0.0, rng.randint(100, 2000), rng.randint(50, 400), None, None, 0)
        for i in range(256)
    ] + [
        (f"w{i}", rng.random() * 2, rng.randint(50, 3000), rng.randint(1, 100), None, None, 0)
        for i in range(300)
    ]
    assert lockstep(new, ref, spec, 1, runs=False) > 300


def test_the_vidur_style_resort_gives_the_same_batches() -> None:
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100")
    config = SchedulerConfig(policy="lars", target_batch_time=0.05)
    new = Scheduler(config, model)
    ref = ReferenceScheduler(config, model, queue=ResortQueue)
    rng = random.Random(9)
    spec = [
        (f"r{i}", rng.random() * 3, rng.randint(50, 4000), rng.randint(1, 60), None, None, 0)
        for i in range(120)
    ]
    assert lockstep(new, ref, spec, 2, runs=False) > 100


@pytest.mark.parametrize(
    "model",
    [
        AffineCostModel(base=2e-3, per_token=2e-5, per_attn=1e-8),
        parse_cost_model_spec("roofline:model=llama3-8b,gpu=a100", layout=ParallelDegrees(tp=8)),
        parse_cost_model_spec("roofline:model=llama3-70b,gpu=h100", layout=ParallelDegrees(kvp=4)),
    ],
)
def test_models_that_claim_affine_decode_features_have_them(model: AggregateCostModel) -> None:
    line = decode_line(model)
    assert line is not None
    a, b = line
    for kv in (0, 1, 2, 17, 4096, 123_457, 10**7 + 3):
        f = model.features(1, kv, True)
        assert all(type(x) is int for x in f), f"features(1, {kv}) are not integers: {f}"
        assert tuple(f) == tuple(x + kv * y for x, y in zip(a, b, strict=True))
    assert all(type(x) is int for x in model.features(1, 65536, False))


def test_float_featured_models_are_priced_one_by_one() -> None:
    model = PolyCostModel(base=1e-3, a=1e-5, b=1e-9, c=0.0, d=0.0, e=0.0)
    assert decode_line(model) is None


@pytest.mark.parametrize("kvp", [1, 2])
def test_decodes_outgrowing_memory_preempt_as_in_the_reference(kvp: int) -> None:
    model = AffineCostModel(
        base=2e-3, per_token=2e-5, per_attn=1e-8, layout=ParallelDegrees(kvp=kvp)
    )
    cache = CacheConfig(block_size=16, num_blocks_per_group=40, max_tokens_per_group=320)
    config = SchedulerConfig(policy="lars", target_batch_time=0.05)
    new, ref = Scheduler(config, model, cache=cache), ReferenceScheduler(config, model, cache=cache)
    spec = [(f"r{i}", 0.001 * i, 40 + 7 * i, 150, None, None, 0) for i in range(12 * kvp)]
    lockstep(new, ref, spec, 3, runs=False)
    assert new.num_preemptions == ref.num_preemptions > 0
