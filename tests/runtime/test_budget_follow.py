"""The automatic budget T follows what a learning cost model learns.

T is derived at start-up from the cost model (``LLMEngine._auto_target_time``);
with a learning model the engine re-derives it every ``BUDGET_EVERY`` steps
when the model's revision moved and its recent predictions are good, and hands
it to the scheduler when it differs by more than ``BUDGET_BAND`` (at most a
factor ``BUDGET_STEP`` a look). A budget the user set never moves.
"""

from __future__ import annotations

import pytest

from medha_runtime import SamplingParams
from medha_runtime.engine import (
    BUDGET_BAND,
    BUDGET_EVERY,
    BUDGET_STEP,
    BUDGET_TRUST,
    LLMEngine,
)
from medha_sched.cost.online import OnlineCostModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KW = {"max_model_len": 256, "kv_cache_tokens": 2048, "num_threads": 1}


def slow_model() -> OnlineCostModel:
    """Far slower than tiny on any CPU: 0.2 s a step plus 2 ms a token."""
    return OnlineCostModel((0.2, 0.0, 2e-3, 0.0, 0.0))


DEVICE = OnlineCostModel((2e-3, 0.0, 2e-5, 0.0, 1e-9))


def look(engine: LLMEngine) -> None:
    """What ``BUDGET_EVERY`` executed steps do to the budget."""
    for _ in range(BUDGET_EVERY):
        engine._follow_budget()


def predicted_with(engine: LLMEngine, error: float) -> None:
    """The model's last ``BUDGET_EVERY`` steps were predicted with this relative error."""
    engine.cost_feedback.recent.extend([0.0] * 60 + [error] * BUDGET_EVERY)


def test_t_follows_the_model_with_hysteresis() -> None:
    engine = LLMEngine("tiny", cost_model=slow_model(), **KW)
    try:
        t0 = engine.scheduler_config.target_batch_time
        # two grid chunks at the end of the 256-token context: 2 * (0.2 + 32 * 2 ms)
        assert t0 == pytest.approx(2 * (0.2 + 32 * 2e-3))
        cost = engine.cost_model
        predicted_with(engine, 0.05)
        look(engine)  # the model has not moved: nothing to do
        assert engine.budget_changes == 0
        cost.rescale(1 + BUDGET_BAND / 2)  # a new revision, but within the band
        look(engine)
        assert engine.scheduler_config.target_batch_time == t0 and engine.budget_changes == 0
        cost.rescale(0.6)
        engine._follow_budget()  # not yet: one look every BUDGET_EVERY steps
        assert engine.budget_changes == 0
        look(engine)
        t1 = engine._auto_target_time(cost)
        assert t1 == pytest.approx(t0 * (1 + BUDGET_BAND / 2) * 0.6)
        assert engine.scheduler_config.target_batch_time == t1
        assert engine.scheduler.config.target_batch_time == t1 and engine.budget_changes == 1
    finally:
        engine.shutdown()


def test_t_follows_only_a_model_that_predicts_well_and_a_step_at_a_time() -> None:
    engine = LLMEngine("tiny", cost_model=slow_model(), **KW)
    try:
        t0 = engine.scheduler_config.target_batch_time
        engine.cost_model.rescale(0.1)
        predicted_with(engine, BUDGET_TRUST * 1.5)  # a model that has lost the device
        look(engine)
        assert engine.scheduler_config.target_batch_time == t0 and engine.budget_changes == 0
        predicted_with(engine, BUDGET_TRUST / 2)
        look(engine)  # at most a factor BUDGET_STEP a look, then on without a new revision
        assert engine.scheduler_config.target_batch_time == pytest.approx(t0 / BUDGET_STEP)
        for _ in range(3):
            look(engine)
        # halved twice more, then within the band of the derived T: it stays there
        t1 = engine.scheduler_config.target_batch_time
        assert t1 == pytest.approx(t0 / BUDGET_STEP**3) and engine.budget_changes == 3
        want = engine._auto_target_time(engine.cost_model)
        assert want == pytest.approx(t0 * 0.1) and abs(t1 - want) <= BUDGET_BAND * t1
    finally:
        engine.shutdown()


def test_t_comes_down_as_the_model_learns_the_device() -> None:
    engine = LLMEngine("tiny", cost_model=slow_model(), **KW)
    try:
        t0 = engine.scheduler_config.target_batch_time
        targets = []
        feedback = engine.cost_feedback
        record = feedback.record

        def observed(out, seconds, stage_s=()):
            # the device, noise-free: 2 ms a step plus 20 us a token (a busy
            # machine's timing noise must not decide what this test sees)
            targets.append(out.target_time)
            return record(out, DEVICE.predict(feedback.batch_work(out)), stage_s)

        engine.cost_feedback.record = observed
        params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        for i in range(4):
            engine.add_request([1 + i, 5, 9, 13] * 30, params)
        while engine.has_unfinished_requests():
            engine.step()
        t1 = engine.scheduler_config.target_batch_time
        # the device runs a step in milliseconds: the learned model prices the
        # end chunk far below what the slow start-up model did
        assert engine.budget_changes >= 2 and t1 < 0.3 * t0
        assert targets[0] == t0 and targets[-1] == t1
        assert t1 >= 0.05  # never below the 50 ms floor
    finally:
        engine.shutdown()


def test_a_budget_the_user_set_stays() -> None:
    engine = LLMEngine("tiny", cost_model=slow_model(), target_batch_time=0.3, **KW)
    try:
        engine.cost_model.rescale(0.1)
        look(engine)
        assert engine.scheduler_config.target_batch_time == 0.3
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request([3, 4, 5] * 20, params)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.scheduler.config.target_batch_time == 0.3 and engine.budget_changes == 0
    finally:
        engine.shutdown()


def test_the_servers_admission_snapshots_follow_a_new_budget() -> None:
    from medha_runtime.server.engine_proc import _current_taker, _snapshot_taker

    engine = LLMEngine("tiny", cost_model=slow_model(), **KW)
    try:
        taker = _snapshot_taker(engine)
        assert _current_taker(engine, taker) is taker  # T as it was: kept
        assert _current_taker(engine, None) is None  # admission off: stays off
        engine.cost_model.rescale(0.5)
        predicted_with(engine, 0.05)
        look(engine)
        assert engine.budget_changes == 1
        fresh = _current_taker(engine, taker)
        assert fresh is not taker
        assert fresh.target_time == engine.scheduler.config.target_batch_time != taker.target_time
        assert fresh._key_cache is engine.scheduler.prefill_times  # the scheduler's new table
    finally:
        engine.shutdown()
