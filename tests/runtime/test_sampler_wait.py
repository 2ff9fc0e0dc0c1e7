"""``MultiprocExecutor.next_event`` with one pipeline stage sleeps until the sampling
rank's reply (or a death), then reads every reply that is there without waiting:
the other ranks' replies, which come first as a rule, no longer wake the driver
once each. A reply, a failure or a death of another rank is still read.

The fakes stand in for the worker processes: each rank is a real pipe (the
driver's end and the worker's end) and a sentinel that becomes readable when
the fake process "dies", so the waits are the executor's own selectors.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import OrderedDict, deque
from multiprocessing import Pipe

import pytest

from medha_runtime.executor import MultiprocExecutor, StageCleared, StepDone, WorkerError
from medha_runtime.messages import Done, Failed, Step
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.sampling_params import Sampled


class _Process:
    """A worker process: alive until :meth:`die`, which makes its sentinel readable."""

    def __init__(self) -> None:
        self.sentinel, self._w = os.pipe()
        self.alive = True
        self.exitcode: int | None = None

    def die(self, code: int = 1) -> None:
        self.alive, self.exitcode = False, code
        os.close(self._w)

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        if self.alive:
            self.die(-9)


def _executor(ranks: int = 2, stages: int = 1, sampler: int = 0):
    """A MultiprocExecutor over fake workers; returns it and the workers' pipe ends."""
    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    workers = []
    ex.conns, ex.processes = [], []
    for _ in range(ranks):
        parent, child = Pipe(duplex=True)
        ex.conns.append(parent)
        workers.append(child)
        ex.processes.append(_Process())
    ex.step_timeout_s, ex.join_timeout_s, ex.poll_s = 600.0, 1.0, 600.0
    ex.closed, ex.failed, ex.timings, ex.last_compute_s = False, None, None, 0.0
    ex._pending, ex._events = OrderedDict(), deque()
    ex._selector = ex._sampler_selector = None
    ex._tmpdir = tempfile.mkdtemp(prefix="medha-test-")
    ex.sampler_rank = sampler
    per_stage = -(-ranks // stages)
    ex._stage_of = {r: r // per_stage for r in range(ranks)}
    ex.stage0 = frozenset(r for r, s in ex._stage_of.items() if s == 0)
    ex._num_stages = stages
    return ex, workers


def _plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, (PlannedChunk("r", 10, (7,), (0,), ()),))


def _submit(ex, workers, step_id: int) -> None:
    ex.submit(_plan(step_id))
    for w in workers:
        assert isinstance(w.recv(), Step)


def _count_blocking(selector, calls: list) -> None:
    select = selector.select

    def counted(timeout=None):
        calls.append(timeout)
        return select(timeout)

    selector.select = counted


def _later(seconds: float, fn) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_other_ranks_reply_first_and_the_driver_wakes_once() -> None:
    ex, workers = _executor()
    _submit(ex, workers, 1)
    workers[1].send(Done(1, 1, None, 0.001))
    workers[0].send(Done(0, 1, [Sampled(5)], 0.002))
    assert isinstance(ex.next_event(), StageCleared)  # builds the selectors
    done = ex.next_event()
    assert isinstance(done, StepDone) and done.result == [Sampled(5)]
    assert ex._sampler_selector is not None
    full: list = []
    narrow: list = []
    _count_blocking(ex._selector, full)
    _count_blocking(ex._sampler_selector, narrow)
    for step in range(2, 6):
        _submit(ex, workers, step)
        workers[1].send(Done(1, step, None, 0.001))  # already there when the driver waits
        t = _later(0.05, lambda s=step: workers[0].send(Done(0, s, [Sampled(s)], 0.002)))
        assert isinstance(ex.next_event(), StageCleared)
        done = ex.next_event()
        t.join()
        assert isinstance(done, StepDone) and done.result == [Sampled(step)]
        assert not ex._pending
    # one sleep per step, on the sampling rank's pipe; the full selector only looked
    assert len(narrow) == 4 and all(timeout > 0 for timeout in narrow)
    assert full == [0, 0, 0, 0]
    ex._kill()


def test_a_later_reply_of_another_rank_is_waited_for() -> None:
    ex, workers = _executor()
    _submit(ex, workers, 1)
    workers[0].send(Done(0, 1, [Sampled(3)], 0.002))
    t = _later(0.05, lambda: workers[1].send(Done(1, 1, None, 0.003)))
    events = [ex.next_event(), ex.next_event()]
    t.join()
    assert isinstance(events[0], StageCleared)
    assert isinstance(events[1], StepDone) and events[1].result == [Sampled(3)]
    assert events[1].stage_s == (0.003,)
    ex._kill()


def test_another_rank_s_failure_is_read_when_its_process_ends() -> None:
    """Rank 1 fails in its step; rank 0 (the sampler) waits for it forever. No
    periodic check (poll_s = 600): its death must bring its traceback in."""
    ex, workers = _executor()
    _submit(ex, workers, 1)

    def fail() -> None:
        workers[1].send(Failed(1, "rank 1 failed in step 1:\nIndexError: block 999"))
        ex.processes[1].die(1)

    t = _later(0.05, fail)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed in step 1:\nIndexError: block 999"):
        ex.next_event()
    t.join()
    assert time.monotonic() - t0 < 30
    assert ex.closed and not any(p.alive for p in ex.processes)


def test_another_rank_s_failure_is_read_after_a_quiet_poll() -> None:
    """The failed rank's process does not end: the quiet poll reads its reply."""
    ex, workers = _executor()
    ex.poll_s = 0.05
    _submit(ex, workers, 1)
    workers[1].send(Failed(1, "rank 1 failed in step 1:\nValueError: x"))
    with pytest.raises(WorkerError, match="ValueError: x"):
        ex.next_event()


def test_a_dead_rank_without_a_reply_is_named() -> None:
    ex, workers = _executor()
    _submit(ex, workers, 1)
    workers[1].send(Done(1, 1, None, 0.001))
    t = _later(0.05, lambda: ex.processes[0].die(-9))
    with pytest.raises(WorkerError, match="rank 0 died during step 1 \\(exit code -9\\)"):
        ex.next_event()
    t.join()


def test_pipeline_stages_wait_on_every_pipe() -> None:
    """With SPP stage 0's replies clear a batch before the sampler replies."""
    ex, workers = _executor(ranks=2, stages=2, sampler=1)
    _submit(ex, workers, 1)
    workers[0].send(Done(0, 1, None, 0.001))
    event = ex.next_event()
    assert isinstance(event, StageCleared) and ex._sampler_selector is None
    workers[1].send(Done(1, 1, [Sampled(2)], 0.002))
    assert isinstance(ex.next_event(), StepDone)
    ex._kill()


@pytest.mark.usefixtures("one_torch_thread")
def test_kvp2_a_step_that_fails_on_the_non_sampling_rank_alone_names_its_error() -> None:
    """Real workers: a KVP decode whose tail's block is outside rank 1's pool fails on
    rank 1 alone (rank 0, the sampler, then waits for rank 1's state in the merge).
    With no periodic check the driver still reads rank 1's traceback."""
    from medha_runtime import LLM
    from medha_sched import AffineCostModel

    cost = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
    with LLM(
        "tiny",
        max_model_len=64,
        kvp=2,
        kvp_group_tokens=32,
        cost_model=cost,
        policy="fcfs",
        chunk_size=16,
        kv_cache_tokens=1024,
        device="cpu",
        timeout_s=60,
    ) as llm:
        ex = llm.engine.executor
        assert isinstance(ex, MultiprocExecutor) and ex.sampler_rank == 0
        ex.poll_s = 600.0
        plan = StepPlan(5, (PlannedChunk("y", 32, (5,), (0, 1), ((0, (0, 1)), (1, (999,)))),))
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1 failed in step 5"):
            ex.execute(plan)
        assert time.monotonic() - t0 < 30
        assert ex._sampler_selector is None and ex.closed  # closed with the executor
