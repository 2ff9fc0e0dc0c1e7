"""The executor interface in one process: submit, events in order, failures; the worker
loop over a pipe with a stand-in runner; the engine's pipeline depth."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from medha_runtime import LLM
from medha_runtime.executor import InProcessExecutor, StageCleared, StepDone
from medha_runtime.messages import Done, Failed, Ping, Shutdown, Step
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.profile import synthetic_plan
from medha_runtime.runner import RunnerSpec
from medha_runtime.transport import PipeTransport
from medha_runtime.worker import serve


def test_in_process_events_come_in_order_and_a_failed_step_is_raised_again() -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    spec = RunnerSpec(model="tiny", dtype="float32", device="cpu", num_blocks=64)
    executor = InProcessExecutor(spec)
    try:
        plans = [
            synthetic_plan(-i, [(4, 0), (1, 0)], block_size=16, num_blocks=64, vocab_size=259)
            for i in (1, 2)
        ]
        for plan in plans:
            executor.submit(plan)
        assert executor.in_flight == 2
        with pytest.raises(RuntimeError, match="in flight"):
            executor.execute(plans[0])
        events = [executor.next_event() for _ in range(4)]
        assert [type(e) for e in events] == [StageCleared, StepDone, StageCleared, StepDone]
        assert [e.step_id for e in events] == [-1, -1, -2, -2]
        assert all(len(e.result) == 2 for e in events if isinstance(e, StepDone))
        assert executor.in_flight == 0
        executor.submit(StepPlan(7, (PlannedChunk("x", 0, (), (0,), ()),)))  # an empty chunk
        with pytest.raises(ValueError, match="empty chunk"):
            executor.next_event()
        with pytest.raises(RuntimeError, match="failed earlier"):
            executor.submit(plans[0])
    finally:
        executor.shutdown()
        torch.set_num_threads(n)


class _ThreadRunner:
    """Stands in for a ModelRunner: records the thread each step ran on."""

    def __init__(self) -> None:
        self.threads: dict[int, str] = {}

    def execute(self, plan: StepPlan) -> list[int]:
        self.threads[plan.step_id] = threading.current_thread().name
        return [plan.step_id]


@pytest.mark.parametrize("pending_tokens", [False, True])
def test_in_process_runs_a_lone_batch_on_the_callers_thread(pending_tokens: bool) -> None:
    """Nothing in flight and no async scheduling: the driver would only wait, so the
    step runs in submit (no sleeping hand-off to the model thread and back); a
    batch submitted behind another one, or with async scheduling, goes to the
    model thread."""
    spec = RunnerSpec(
        model="tiny", dtype="float32", device="cpu", num_blocks=16, pending_tokens=pending_tokens
    )
    executor = InProcessExecutor(spec)
    runner = executor.runner = _ThreadRunner()  # type: ignore[assignment]
    me = threading.current_thread().name
    try:
        executor.submit(StepPlan(1, ()))
        assert (runner.threads.get(1) == me) is not pending_tokens
        assert executor.inline_step == (None if pending_tokens else 1)
        executor.submit(StepPlan(2, ()))  # behind step 1: the model thread
        assert executor.inline_step is None
        events = [executor.next_event() for _ in range(4)]
        assert [e.step_id for e in events] == [1, 1, 2, 2]
        assert [e.result for e in events if isinstance(e, StepDone)] == [[1], [2]]
        assert all(len(e.stage_s) == 1 and e.stage_s[0] >= 0 for e in events[1::2])
        assert runner.threads[2] == "medha-model"
        executor.submit(StepPlan(3, ()))
        assert executor.in_flight == 1
        assert [type(executor.next_event()) for _ in range(2)] == [StageCleared, StepDone]
        assert (runner.threads[3] == me) is not pending_tokens
    finally:
        executor.shutdown()


class _Runner:
    """Stands in for a ModelRunner: echoes the step id, fails on step 3."""

    def execute(self, plan: StepPlan) -> list[int]:
        if plan.step_id == 3:
            raise ValueError("step three is bad")
        return [plan.step_id]


def test_worker_loop_answers_typed_messages_in_order_and_stops_on_failure() -> None:
    driver, worker = mp.Pipe(duplex=True)
    for msg in (Step(StepPlan(1, ())), Ping(), Step(StepPlan(2, ())), Step(StepPlan(3, ()))):
        driver.send(msg)
    assert serve(_Runner(), PipeTransport(worker), rank=5) == 1
    first, second, third = driver.recv(), driver.recv(), driver.recv()
    assert (first.rank, first.step_id, first.result) == (5, 1, [1])
    assert isinstance(second, Done) and second.step_id == 2 and second.compute_s >= 0
    assert isinstance(third, Failed) and "step three is bad" in third.error
    driver.send(Shutdown())
    assert serve(_Runner(), PipeTransport(worker), rank=5) == 0
    driver.close()
    assert serve(_Runner(), PipeTransport(worker), rank=5) == 1  # the driver is gone


def test_pipeline_depth_is_validated() -> None:
    cost = "affine:base=1e-3,per_token=1e-5,per_attn=1e-9"
    with LLM("tiny", max_model_len=64, kv_cache_tokens=256, cost_model=cost) as llm:
        assert llm.engine.pipeline_depth == 1  # spp = 1
        llm.engine.pipeline_depth = 2
        assert llm.engine.pipeline_depth == 2
        with pytest.raises(ValueError, match="pipeline_depth must be an integer >= 1, got 0"):
            llm.engine.pipeline_depth = 0


class _FailingRunner:
    """Wraps a ModelRunner: raises ``error`` in its ``fail_at``-th step (1-based)."""

    def __init__(self, runner: object, error: BaseException, fail_at: int) -> None:
        self.runner, self.error, self.fail_at, self.calls = runner, error, fail_at, 0

    def execute(self, plan: StepPlan) -> object:
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.runner.execute(plan)  # type: ignore[attr-defined]


def _in_thread(fn: object, timeout_s: float = 60.0) -> BaseException | None:
    """Run ``fn()`` in a thread; its exception (None if it returned). A call that
    does not end in ``timeout_s`` fails the test instead of hanging it."""
    caught: list[BaseException] = []

    def target() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as exc:  # KeyboardInterrupt included
            caught.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the call hung"
    return caught[0] if caught else None


@pytest.mark.parametrize("pending_tokens", [False, True])
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failed_step_makes_later_generates_raise_at_once(
    error: BaseException, pending_tokens: bool
) -> None:
    """A step that raises (any exception, Ctrl-C included, inline or on the model
    thread) reaches the caller, and every later generate raises WorkerError at
    once: the executor's results stopped at the failed step, so waiting for
    them would block forever."""
    from medha_runtime import SamplingParams
    from medha_runtime.executor import WorkerError

    cost = "affine:base=1e-3,per_token=1e-5,per_attn=1e-9"
    with LLM(
        "tiny",
        max_model_len=64,
        kv_cache_tokens=256,
        cost_model=cost,
        async_scheduling=pending_tokens,
    ) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, InProcessExecutor)
        executor.runner = _FailingRunner(executor.runner, error, 3)  # type: ignore[assignment]
        params = SamplingParams(max_tokens=8, temperature=0.0)
        first = _in_thread(lambda: llm.generate(["hello there"], params))
        assert type(first) is type(error)
        assert llm.engine.dead is not None and type(error).__name__ in llm.engine.dead
        again = _in_thread(lambda: llm.generate(["hello again"], params))
        assert isinstance(again, WorkerError)
        assert "unusable after an earlier failure" in str(again)
        # the executor on its own: nothing left to deliver, so it raises too
        with pytest.raises(WorkerError, match="failed earlier"):
            executor.next_event()
