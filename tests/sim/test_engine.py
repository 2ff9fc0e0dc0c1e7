"""The event loop driving the real scheduler: hand-checked timings and invariants."""

from __future__ import annotations

import random

import pytest

from medha_sched import AffineCostModel, CacheConfig, ParallelDegrees, SchedulerConfig
from medha_sched.sim import TraceRequest, simulate
from medha_sched.sim.engine import Simulator
from medha_sched.sim.metrics import percentile
from medha_sched.sim.pipeline import Pipeline
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate

BIG_CACHE = CacheConfig(block_size=16, num_blocks_per_group=1 << 16)  # 1M tokens


def affine(spp: int = 1, kvp: int = 1, **kw: float) -> AffineCostModel:
    params = {"base": 0.01, "per_token": 1e-4, "per_attn": 0.0, **kw}
    return AffineCostModel(**params, layout=ParallelDegrees(spp=spp, kvp=kvp))


TINY = [TraceRequest("A", 0.0, 300, 3), TraceRequest("B", 0.005, 200, 2)]


def test_tiny_scenario_by_hand_without_pipelining() -> None:
    # T = 50 ms, batch time = 10 ms + 0.1 ms per token.
    # t=0      A's 300-token prompt alone: 40 ms              -> A's 1st token at 0.0400
    # t=0.04   A decode + B's whole 200-token prompt: 30.1 ms -> B's 1st token at 0.0701
    # t=0.0701 A and B decode: 10.2 ms -> A's 3rd and B's 2nd (last) token at 0.0803
    res = simulate(TINY, SchedulerConfig(policy="fcfs", target_batch_time=0.05), affine())
    a, b = res.records
    assert a.ttft_s == pytest.approx(0.04)
    assert b.ttft_s == pytest.approx(0.0701 - 0.005)
    assert a.finish_s == pytest.approx(0.0803) and b.finish_s == pytest.approx(0.0803)
    assert a.tpot_s == pytest.approx((0.0803 - 0.04) / 2)
    assert b.tpot_s == pytest.approx(0.0803 - 0.0701)
    assert a.e2e_s == pytest.approx(0.0803)
    # D = max(1.5 * predicted prefill, 0.5 s) = 0.5 s, fixed at arrival
    assert a.deadline_s == pytest.approx(0.5) and b.deadline_s == pytest.approx(0.505)
    assert a.met_deadline and b.met_deadline
    got = [
        (it.start_s, it.predicted_s, it.decodes, it.prefill_chunks, it.prefill_tokens)
        for it in res.iterations
    ]
    want = [(0.0, 0.04, 0, 1, 300), (0.04, 0.0301, 1, 1, 200), (0.0701, 0.0102, 2, 0, 0)]
    assert got == [pytest.approx(w) for w in want]


def test_admission_delay_by_hand() -> None:
    # Each request reaches the scheduler 20 ms after it arrives; latencies still
    # count from the arrival. A at 0.02 runs alone (40 ms): its first token at
    # 0.06. B reaches the scheduler at 0.025, mid-batch, so the batches are those
    # of the run without the delay, 20 ms later.
    config = SchedulerConfig(policy="fcfs", target_batch_time=0.05)
    plain = simulate(TINY, config, affine())
    res = simulate(TINY, config, affine(), admission_delay_s=0.02)
    a, b = res.records
    assert a.arrival_s == 0.0 and b.arrival_s == 0.005  # the trace's arrivals
    assert a.ttft_s == pytest.approx(0.06)
    assert b.ttft_s == pytest.approx(0.0901 - 0.005)
    assert a.deadline_s == pytest.approx(0.52)  # fixed when the scheduler sees it
    for delayed, undelayed in zip(res.records, plain.records, strict=True):
        assert delayed.ttft_s == pytest.approx(undelayed.ttft_s + 0.02)
        assert delayed.tpot_s == pytest.approx(undelayed.tpot_s)
    assert [it.start_s for it in res.iterations] == pytest.approx(
        [it.start_s + 0.02 for it in plain.iterations]
    )


def test_admission_delay_shifts_a_busy_trace_by_exactly_the_delay() -> None:
    # Delaying every arrival by d is the same run as the trace shifted by d.
    spec = WorkloadSpec(
        qps=4.0,
        duration_s=10.0,
        long_fraction=0.05,
        seed=3,
        max_context=32768,
        long_min_prompt=8192,
    )
    trace = generate(spec)
    shifted = [
        TraceRequest(t.id, t.arrival_s + 0.25, t.prompt_tokens, t.output_tokens) for t in trace
    ]
    config = SchedulerConfig(policy="lars-mp", target_batch_time=0.05)
    model = affine(per_attn=1e-9)
    res = simulate(trace, config, model, cache=BIG_CACHE, admission_delay_s=0.25)
    ref = simulate(shifted, config, model, cache=BIG_CACHE)
    assert len(res.iterations) == len(ref.iterations) > 0
    for got, want in zip(res.records, ref.records, strict=True):
        assert got.first_token_s == pytest.approx(want.first_token_s)
        assert got.ttft_s == pytest.approx(want.ttft_s + 0.25)


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf")])
def test_admission_delay_must_be_finite_and_non_negative(bad: float) -> None:
    config = SchedulerConfig(policy="fcfs")
    with pytest.raises(ValueError, match="admission_delay_s"):
        simulate(TINY, config, affine(), admission_delay_s=bad)
    with pytest.raises(ValueError, match="--admission-delay"):
        RunSpec(admission_delay_s=bad).build()


def test_tiny_scenario_by_hand_with_two_stages() -> None:
    # Same batches' latencies, each stage busy for half of it, FIFO through 2 stages.
    # batch 0 (A prefill, 40 ms):   stage 0 [0, .02],        stage 1 [.02, .04]
    # batch 1 (B prefill, 30 ms):   stage 0 [.02, .035],     stage 1 [.04, .055]  (waits for 1)
    # batch 2 (A decode, 10.1 ms):  stage 0 [.04, .04505],   stage 1 [.055, .06005]
    # batch 3 (B decode, 10.1 ms):  stage 0 [.055, .06005],  stage 1 [.06005, .0651]
    # batch 4 (A decode, 10.1 ms):  stage 0 [.06005, .0651], stage 1 [.0651, .07015]
    res = simulate(TINY, SchedulerConfig(policy="fcfs", target_batch_time=0.05), affine(spp=2))
    a, b = res.records
    assert a.first_token_s == pytest.approx(0.04)
    assert b.first_token_s == pytest.approx(0.055)
    assert b.finish_s == pytest.approx(0.0651)
    assert a.finish_s == pytest.approx(0.07015)
    starts = [it.start_s for it in res.iterations]
    assert starts == pytest.approx([0.0, 0.02, 0.04, 0.055, 0.06005])


def test_stage_overlap_finishes_a_long_prefill_earlier() -> None:
    # Chunks of 4000 tokens fill T = 50 ms exactly (10 ms + 4000 * 10 us).
    # One stage: 10 chunks back to back = 0.5 s. Two stages of 25 ms: a chunk
    # is issued as soon as the previous one leaves stage 0, so the 10th is
    # issued at 0.225 s and its token exists at 0.275 s.
    trace = [TraceRequest("long", 0.0, 40_000, 1)]
    config = SchedulerConfig(policy="lars", target_batch_time=0.05)
    one = simulate(trace, config, affine(per_token=1e-5), cache=BIG_CACHE).records[0]
    two = simulate(trace, config, affine(spp=2, per_token=1e-5), cache=BIG_CACHE).records[0]
    assert one.ttft_s == pytest.approx(0.5)
    assert two.ttft_s == pytest.approx(0.275)


def test_pipeline_is_fifo_and_stage0_exclusive() -> None:
    rng = random.Random(0)
    for stages in (1, 2, 4):
        pipe, now, last_end, last_stage0 = Pipeline(stages), 0.0, 0.0, 0.0
        for _ in range(500):
            now = (
                max(now + rng.expovariate(20.0), pipe.stage0_free_at)
                if rng.random() < 0.8
                else now + 1.0
            )
            assert pipe.stage0_free(now)
            stage_time = rng.uniform(0.001, 0.05)
            s0, end = pipe.push(now, stage_time)
            assert s0 == pytest.approx(max(now, last_stage0) + stage_time)
            assert end >= last_end and end >= s0 + (stages - 1) * stage_time - 1e-12
            last_end, last_stage0 = end, s0


def mixed_trace(n: int = 150, qps: float = 2.0, seed: int = 0) -> list[TraceRequest]:
    return generate(WorkloadSpec(qps=qps, num_requests=n, long_fraction=0.05, seed=seed))


@pytest.fixture(scope="module")
def paper_run():
    config, model, cache = RunSpec(policy="lars-mp", tp=8, spp=2).build()
    trace = mixed_trace()
    done: list[int] = []
    return trace, simulate(trace, config, model, cache=cache, progress=done.append), done


def test_every_request_finishes_with_sane_times(paper_run) -> None:
    trace, res, done = paper_run
    assert sum(done) == len(trace)  # the progress callback saw every request
    assert [r.id for r in res.records] == [t.id for t in trace]
    assert any(t.prompt_tokens >= 1 << 17 for t in trace)
    for t, r in zip(trace, res.records, strict=True):
        assert r.rejected is None and r.finished
        assert r.ttft_s is not None and r.ttft_s > 0
        assert r.arrival_s <= r.first_token_s <= r.finish_s
        assert (r.tpot_s is None) == (t.output_tokens == 1)
        assert r.deadline_s is not None and r.deadline_s >= r.arrival_s + 0.5
    starts = [it.start_s for it in res.iterations]
    assert starts == sorted(starts)
    for prev, cur in zip(res.iterations, res.iterations[1:], strict=False):
        assert cur.start_s >= prev.start_s + prev.predicted_s / 2 - 1e-9  # stage 0 is exclusive
    tokens = sum(it.tokens for it in res.iterations)
    assert tokens == sum(t.prompt_tokens + t.output_tokens - 1 for t in trace)


def test_same_input_same_result(paper_run) -> None:
    trace, res, _ = paper_run
    config, model, cache = RunSpec(policy="lars-mp", tp=8, spp=2).build()
    again = simulate(trace, config, model, cache=cache)
    assert again.records == res.records and again.iterations == res.iterations


def test_too_long_requests_are_rejected_not_fatal() -> None:
    trace = [TraceRequest("ok", 0.0, 1000, 4), TraceRequest("huge", 0.1, 70_000, 4)]
    cache = CacheConfig(block_size=16, num_blocks_per_group=4096)  # 64K tokens
    res = simulate(trace, SchedulerConfig(target_batch_time=0.05), affine(), cache=cache)
    ok, huge = res.records
    assert ok.finished and huge.rejected is not None and "maximum context" in huge.rejected
    assert huge.ttft_s is None and not huge.met_deadline


def test_kvp_groups_serve_a_request_one_group_cannot_hold() -> None:
    trace = [TraceRequest("big", 0.0, 100_000, 8), TraceRequest("chat", 0.5, 200, 8)]
    config = SchedulerConfig(policy="lars", target_batch_time=0.05)
    cache = CacheConfig(block_size=16, num_blocks_per_group=4096, max_tokens_per_group=57344)
    one = simulate(trace, config, affine(), cache=cache)
    assert one.records[0].rejected is not None
    two = simulate(trace, config, affine(kvp=2), cache=cache)
    assert all(r.finished for r in two.records)
    assert two.records[0].ttft_s > 100_000 * 1e-4  # at least the linear work of the prompt


def convoy_trace() -> list[TraceRequest]:
    chats = [TraceRequest(f"c{i}", 0.01 + 0.05 * i, 300, 16) for i in range(80)]
    return [TraceRequest("long", 0.0, 200_000, 16), *chats]


def short_p90_ttft(policy: str, chunk: int | None) -> float:
    model = AffineCostModel(base=5e-3, per_token=4e-5, per_attn=2e-10)
    config = SchedulerConfig(policy=policy, target_batch_time=0.05, chunk_size=chunk)
    res = simulate(convoy_trace(), config, model, cache=BIG_CACHE)
    assert all(r.finished for r in res.records)
    p90 = percentile([r.ttft_s for r in res.records if r.id != "long"], 90)
    assert p90 is not None
    return p90


def test_lars_beats_non_preemptive_fcfs_on_short_ttft() -> None:
    fcfs = short_p90_ttft("fcfs", 0)
    lars = short_p90_ttft("lars", None)
    assert fcfs > 5.0  # the chats queue behind a 16 s prefill
    assert lars < fcfs / 5


def test_simulator_can_run_twice() -> None:
    sim = Simulator(SchedulerConfig(policy="fcfs", target_batch_time=0.05), affine())
    first = sim.run(TINY)
    second = sim.run(TINY)
    assert first.records == second.records
