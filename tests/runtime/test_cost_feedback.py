"""CostFeedback under stream pipelining: the model learns one batch's latency
through all stages (the sum of the stages' own times), not the executor's wall
time, which with SPP > 1 includes waiting behind the previous batch."""

from __future__ import annotations

import random
import statistics

import pytest

from medha_runtime import LLM, SamplingParams
from medha_runtime.cost_feedback import CostFeedback
from medha_sched.config import ParallelDegrees
from medha_sched.cost.online import OnlineCostModel
from medha_sched.output import ScheduledChunk, ScheduleOutput

TRUE = OnlineCostModel((4e-3, 0.0, 2e-5, 0.0, 1e-9))  # the device: one batch, all stages


def _batch(rng: random.Random, i: int, model: OnlineCostModel) -> ScheduleOutput:
    start, n = rng.choice([(0, 64), (128, 32), (300, 1), (512, 128), (40, 1)])
    chunk = ScheduledChunk(f"r{i}", start, n, (0,), samples=True)
    out = ScheduleOutput(batch_id=i, time=0.0, prefill_chunks=(chunk,))
    return ScheduleOutput(
        batch_id=i,
        time=0.0,
        prefill_chunks=(chunk,),
        target_time=0.05,
        predicted_time=model.predict(CostFeedback(model, group_limit=1 << 20).batch_work(out)),
    )


def test_spp2_learns_the_sum_of_stage_times_not_the_wall_time() -> None:
    layout = ParallelDegrees(spp=2)
    model = OnlineCostModel((1e-3, 0.0, 5e-6, 0.0, 1e-10), layout=layout)  # 4x too low
    feedback = CostFeedback(model, group_limit=1 << 20)
    assert not feedback.learning  # nothing measured yet
    rng = random.Random(0)
    truth = CostFeedback(TRUE, group_limit=1 << 20)
    errors = []
    for i in range(200):
        out = _batch(rng, i, model)
        latency = TRUE.predict(truth.batch_work(out))
        stages = (0.55 * latency, 0.45 * latency)
        wall = 1.7 * latency  # queued behind the previous batch on stage 1
        errors.append(feedback.record(out, wall, stages))
        assert errors[-1] == pytest.approx(abs(out.predicted_time - latency) / latency)
    assert feedback.learning and model.steps > 0
    assert errors[0] > 0.5  # the prior was 4x low
    assert statistics.median(errors[-50:]) < 0.02  # it predicts the latency, not the wall
    for q, kv in [(64, 0), (1, 300), (128, 512)]:
        probe = ScheduleOutput(
            batch_id=0, time=0.0, prefill_chunks=(ScheduledChunk("p", kv, q, (0,), samples=True),)
        )
        work = feedback.batch_work(probe)
        assert model.predict(work) == pytest.approx(TRUE.predict(work), rel=0.05)


def test_spp2_without_stage_times_measures_but_does_not_learn() -> None:
    model = OnlineCostModel((1e-3, 0.0, 5e-6, 0.0, 1e-10), layout=ParallelDegrees(spp=2))
    feedback = CostFeedback(model, group_limit=1 << 20)
    out = _batch(random.Random(1), 0, model)
    before = model.coefficients
    error = feedback.record(out, 0.02)  # the torch.distributed executor: no stage times
    assert error == pytest.approx(abs(out.predicted_time - 0.02) / 0.02)
    assert feedback.record(out, 0.02, (0.01,)) is not None  # one stage of two: not a latency
    assert not feedback.learning and model.coefficients == before and model.steps == 0
    assert not feedback.rescue()


def test_spp1_keeps_the_wall_time() -> None:
    model = OnlineCostModel((1e-3, 0.0, 5e-6, 0.0, 1e-10))
    feedback = CostFeedback(model, group_limit=1 << 20)
    out = _batch(random.Random(2), 0, model)
    assert feedback.learning
    assert feedback.record(out, 0.02, (0.5,)) == pytest.approx(
        abs(out.predicted_time - 0.02) / 0.02
    )
    assert len(model.errors) + model.steps == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_spp2_learns_from_the_workers_stage_times() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = "Medha shards the KV cache of long prompts " * 4
    kw = {"max_model_len": 256, "spp": 2, "chunk_size": 16, "kv_cache_tokens": 1024}
    with LLM("tiny", device="cpu", **kw) as llm:  # two gloo ranks on any machine
        cost, feedback = llm.engine.cost_model, llm.engine.cost_feedback
        assert isinstance(cost, OnlineCostModel)
        before = cost.coefficients
        seen = []
        record = feedback.record

        def observed(out, seconds, stage_s=()):
            error = record(out, seconds, stage_s)
            seen.append((out.predicted_time, seconds, stage_s, error))
            return error

        feedback.record = observed
        llm.generate([prompt, "Hi", "The sky over the port was"], params)
        assert len(seen) == feedback.steps
        for predicted, wall, stages, error in seen:
            # each stage's own time, measured by its worker; the error is against their sum
            assert len(stages) == 2 and all(0 < t <= wall for t in stages)
            assert error == pytest.approx(abs(predicted - sum(stages)) / sum(stages))
        assert llm.engine.stats.max_in_flight == 2  # the stages overlapped
        assert feedback.learning and feedback.steps >= 8
        assert cost.steps + len(cost.errors) >= feedback.steps - 1  # every step reached it
        assert cost.coefficients != before


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("tp", [1, 2])
def test_distributed_executor_spp2_learns_from_the_stage_times(monkeypatch, tp) -> None:
    """The torch.distributed executor (this process is rank 0 on stage 0, local
    workers for the other ranks; with TP2 ranks 1 and 3 send only their times):
    the cost model trains on the stage sums, not the wall time."""
    from medha_runtime.dist_config import RENDEZVOUS_ENV, DistConfig
    from medha_runtime.dist_executor import DistributedExecutor
    from tests.server.conftest import free_port

    for name in RENDEZVOUS_ENV:
        monkeypatch.delenv(name, raising=False)
    world = 2 * tp
    dist = DistConfig(
        world_size=world, local_ranks=world, master_port=free_port(), control_timeout_s=60
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = "Medha shards the KV cache of long prompts " * 4
    kw = {"max_model_len": 256, "spp": 2, "tp": tp, "chunk_size": 16, "kv_cache_tokens": 1024}
    with LLM("tiny", device="cpu", distributed=dist, **kw) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, DistributedExecutor)
        assert executor._reply_ranks == tuple(range(1, world))  # each worker's times
        cost, feedback = llm.engine.cost_model, llm.engine.cost_feedback
        assert isinstance(cost, OnlineCostModel)
        before = cost.coefficients
        seen, targets = [], []
        record, observe = feedback.record, cost.observe

        def recorded(out, seconds, stage_s=()):
            error = record(out, seconds, stage_s)
            seen.append((out.predicted_time, seconds, stage_s, error))
            return error

        def observed(batch, seconds):
            targets.append(seconds)
            return observe(batch, seconds)

        feedback.record, cost.observe = recorded, observed
        llm.generate([prompt, "Hi", "The sky over the port was"], params)
    assert len(seen) == feedback.steps >= 8
    for predicted, wall, stages, error in seen:
        # each stage's own time (rank 0 times stage 0, the worker stage 1): no waits
        assert len(stages) == 2 and all(0 < t <= wall for t in stages)
        assert error == pytest.approx(abs(predicted - sum(stages)) / sum(stages))
    assert llm.engine.stats.max_in_flight == 2  # the stages overlapped
    assert feedback.learning
    # the training targets are the stage sums, one per step, not the wall times
    assert targets == [sum(stages) for _, _, stages, _ in seen]
    assert sum(targets) < sum(wall for _, wall, _, _ in seen)
    assert cost.steps > 0 and cost.coefficients != before
    assert [p.exitcode for p in executor.processes] == [0] * (world - 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_times_a_step_by_its_own_seconds_and_notes_what_it_issued(
    tmp_path, async_scheduling: bool
) -> None:
    """A step run inline (in submit) or behind another one (async scheduling) is
    measured by the executor's own seconds for it, for the cost model and the
    step log: the driver detokenized the previous batch's text between submit
    and asking for the result (that goes to the overhead). Every batch shipped
    is noted to the cost model (``note_issued``), in order, before it is timed."""
    from medha_runtime.executor import StepDone
    from medha_runtime.step_log import read_step_log

    cost = "online:prior=affine:base=1e-3,per_token=1e-5,per_attn=1e-9"
    path = tmp_path / "steps.jsonl"
    with LLM(
        "tiny",
        max_model_len=64,
        kv_cache_tokens=256,
        cost_model=cost,
        step_log=path,
        async_scheduling=async_scheduling,
    ) as llm:
        engine = llm.engine
        model, executor, feedback = engine.cost_model, engine.executor, engine.cost_feedback
        issued: list[object] = []
        own: dict[int, tuple[float, bool]] = {}
        measured: list[tuple[int, float]] = []
        note, next_event, record = model.note_issued, executor.next_event, feedback.record

        def noting(batch):
            issued.append(batch)
            note(batch)

        def spying():
            event = next_event()
            if isinstance(event, StepDone):
                own[event.step_id] = (event.stage_s[0], executor.inline_step == event.step_id)
            return event

        def recording(out, seconds, stage_s=()):
            assert len(issued) >= len(measured) + 1  # noted when shipped
            measured.append((out.batch_id, seconds))
            return record(out, seconds, stage_s)

        model.note_issued, executor.next_event, feedback.record = noting, spying, recording
        params = SamplingParams(max_tokens=6, temperature=0.0)
        llm.generate(["hello there", "a b c d"], params)
        steps = engine.stats.steps
    assert len(issued) == len(measured) == steps > 3
    assert [b for b, _ in measured] == sorted(own)
    assert all(seconds == own[b][0] for b, seconds in measured)
    assert all(inline is not async_scheduling for _, inline in own.values())
    records = read_step_log(path)
    assert len(records) == steps
    for r in records:
        assert r.execute_s == pytest.approx(own[r.step][0], abs=1e-6)  # logged in us


def test_the_work_priced_at_issue_is_the_work_learned_once() -> None:
    """``issued`` computes a shipped batch's work once; ``record`` learns from
    that very object and forgets it (nothing kept after the step)."""
    model = OnlineCostModel((1e-3, 0.0, 5e-6, 0.0, 1e-10))
    feedback = CostFeedback(model, group_limit=1 << 20)
    seen = []
    observe = model.observe
    model.observe = lambda work, latency: (seen.append(work), observe(work, latency))  # type: ignore[method-assign]
    outs = [_batch(random.Random(3), i, model) for i in range(2)]
    works = [feedback.issued(out) for out in outs]
    assert works[0] == feedback.batch_work(outs[0])
    feedback.record(outs[1], 0.02)
    feedback.record(outs[0], 0.0)  # not measured: learns nothing, still forgotten
    assert seen == [works[1]] and seen[0] is works[1]
    assert feedback._issued == {}
    feedback.record(outs[0], 0.02)  # not issued through ``issued``: computed here
    assert len(seen) == 2 and seen[1] is not works[0] and seen[1] == works[0]
