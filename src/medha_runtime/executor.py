"""Executors: run :class:`~medha_runtime.plan.StepPlan` s on one process or on one
process per rank.

Every executor has one interface (:class:`Executor`): :meth:`~Executor.submit`
ships a plan to every rank without waiting, :meth:`~Executor.next_event`
returns what happened next, in order: :class:`StageCleared` (the batch left
pipeline stage 0: with SPP the next batch may enter it) and then
:class:`StepDone` (every rank finished; the sampled rows). Batches finish in
the order they were submitted. :meth:`~Executor.execute` is submit-and-wait
for one batch when nothing else is in flight.

- :class:`InProcessExecutor` (world size 1): a :class:`~medha_runtime.runner.ModelRunner`
  in the caller's process, run by one model thread (the driver works on the
  previous batch's results meanwhile).
- :class:`MultiprocExecutor` (world size > 1): one worker process per rank,
  started with ``torch.multiprocessing``'s forkserver method, joined into one
  ``torch.distributed`` group (gloo on CPUs, NCCL on GPUs) through a
  ``file://`` rendezvous in a private temporary directory. Each worker runs
  :func:`medha_runtime.worker.serve` over its own ``multiprocessing`` pipe
  (typed messages, :mod:`medha_runtime.messages`). The driver (the caller's
  process; it is no rank) sends each plan to every worker (pickled once) and
  reads replies as they come: stage 0's ranks reply when their share is done
  (their hidden states are posted to stage 1), so up to ``spp`` batches can be
  in flight, one per stage; the sampling rank's reply carries the tokens.

  Failures surface as :class:`WorkerError` in the driver, never as a hang:
  a worker that raises sends its traceback; a worker that dies is seen at
  once through its process sentinel, which every wait watches beside the
  pipes; a wait with no reply from any rank for ``step_timeout_s`` fails.
  Ranks blocked in a collective with a dead peer give up after the
  collective timeout (``RunnerSpec.timeout_s``).
  After a failure every worker is killed and the executor refuses further steps.

  :meth:`MultiprocExecutor.shutdown` sends a shutdown message, joins the
  workers (``join_timeout_s``), kills stragglers and removes the temporary
  directory. Workers are daemonic, so they also die with the driver, and a
  worker whose pipe closes exits by itself.

- :class:`~medha_runtime.dist_executor.DistributedExecutor` (several nodes, or
  torchrun): the driver is rank 0 of an ``env://`` world; see
  :func:`make_executor`.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue
import selectors
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, Protocol

from medha_runtime.dist_config import DistConfig
from medha_runtime.messages import Done, Failed, Ready, Shutdown, Step
from medha_runtime.plan import StepPlan
from medha_runtime.runner import ModelRunner, RunnerSpec, resolve_device
from medha_runtime.sampling import Sampled
from medha_runtime.transport import read_message, write_message

#: how long a rank's failure waits for another rank's death to show (see
#: ``MultiprocExecutor._fail_after_peer``)
PEER_DEATH_WAIT_S = 1.0


class WorkerError(RuntimeError):
    """A worker failed, died or timed out; the executor is unusable afterwards."""


@dataclass(frozen=True, slots=True)
class StageCleared:
    """Batch ``step_id`` left pipeline stage 0 (every stage-0 rank is done with it)."""

    step_id: int


@dataclass(frozen=True, slots=True)
class StepDone:
    """Batch ``step_id`` finished on every rank; ``result`` holds the sampled rows in plan order.

    ``stage_s`` holds, per pipeline stage in order, the seconds that stage spent
    on the batch (the slowest of its ranks, without the wait for the previous
    stage; the torch.distributed executor with spp = 1 reports rank 0's own
    seconds, rank 0 being the sampling rank); empty where the executor does
    not measure stages.
    """

    step_id: int
    result: list[Sampled]
    stage_s: tuple[float, ...] = ()


StepEvent = StageCleared | StepDone


def check_usable(executor: Any) -> None:
    """WorkerError if a multi-process executor failed earlier or was shut down."""
    if executor.failed is not None:
        raise WorkerError(f"the workers failed earlier: {executor.failed}")
    if executor.closed:
        raise WorkerError("the executor was shut down")


class Executor(Protocol):
    spec: RunnerSpec
    #: why the workers can run no more steps, or None
    failed: str | None

    @property
    def in_flight(self) -> int:
        """Batches submitted whose :class:`StepDone` was not yet returned."""
        ...

    def submit(self, plan: StepPlan) -> None:
        """Ship one step to every rank without waiting for it."""
        ...

    def next_event(self) -> StepEvent:
        """The next :class:`StageCleared` or :class:`StepDone` (blocking; a batch is in flight)."""
        ...

    def execute(self, plan: StepPlan) -> list[Sampled]:
        """Run one step on every rank (nothing else in flight); return the sampled rows."""
        ...

    def check_workers(self) -> None:
        """Between steps: notice a worker that died (sets :attr:`failed`)."""
        ...

    def shutdown(self) -> None: ...


class SyncEvents:
    """For executors whose :meth:`submit` runs the whole step before returning:
    the events wait in a queue."""

    def __init__(self) -> None:
        self._events: deque[StepEvent] = deque()
        self._submitted = 0

    @property
    def in_flight(self) -> int:
        return self._submitted

    def _completed(self, plan: StepPlan, result: list[Sampled] | None) -> None:
        self._submitted += 1
        self._events.append(StageCleared(plan.step_id))
        self._events.append(StepDone(plan.step_id, [] if result is None else result))

    def next_event(self) -> StepEvent:
        if not self._events:
            raise RuntimeError("next_event: no batch in flight")
        event = self._events.popleft()
        if isinstance(event, StepDone):
            self._submitted -= 1
        return event

    def submit(self, plan: StepPlan) -> None:
        self._completed(plan, self._run(plan))  # type: ignore[attr-defined]

    def execute(self, plan: StepPlan) -> list[Sampled]:
        if self._submitted:
            raise RuntimeError("execute: other batches are in flight")
        result = self._run(plan)  # type: ignore[attr-defined]
        return [] if result is None else result


class InProcessExecutor:
    """The whole model in the caller's process (tp = spp = kvp = 1).

    With async scheduling (``spec.pending_tokens``), or while another batch
    is in flight, :meth:`submit` hands the step to one model thread and
    returns, so the driver forms the next batch and reads back the previous
    batch's tokens (detokenize, check stop strings) while the model runs.
    Otherwise the driver would only wait for it: :meth:`submit` runs the step
    in the caller's thread before returning, which spares two thread
    hand-offs that sleep (the model thread's wake-up, then the driver's; on
    a 2-core VM 0.02-0.06 ms each at the median, 0.2 ms at p90 and
    milliseconds when other processes load the cores: noise on a 1 ms decode
    step that its measured time held).
    :meth:`execute` runs a step in the caller's thread. An exception in a
    step is raised again by :meth:`next_event` (and the executor refuses
    further steps: :meth:`submit` and :meth:`next_event` then raise
    :class:`WorkerError`). A KeyboardInterrupt (or SystemExit) in a step run
    by :meth:`submit` is recorded as the failure and raised from it.
    """

    def __init__(self, spec: RunnerSpec) -> None:
        if spec.world_size != 1:
            raise ValueError(f"InProcessExecutor runs one rank, the layout has {spec.world_size}")
        self.spec = spec
        self.runner = ModelRunner(spec)
        self.closed = False
        self.failed: str | None = None
        self._jobs: queue.SimpleQueue[StepPlan | None] = queue.SimpleQueue()
        # (step id, sampled rows, error, seconds the model thread spent on the step)
        self._results: queue.SimpleQueue[tuple[int, Any, BaseException | None, float]] = (
            queue.SimpleQueue()
        )
        self._events: deque[StepEvent] = deque()
        self._submitted = 0
        self._thread: threading.Thread | None = None
        #: the id of the last step :meth:`submit` ran in the caller's thread (its
        #: StepDone's ``stage_s[0]`` is its own time), None once one went to the
        #: model thread
        self.inline_step: int | None = None

    @property
    def in_flight(self) -> int:
        return self._submitted

    def check_workers(self) -> None:
        """Nothing to check: the model runs in this process."""

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise WorkerError(f"the model failed earlier: {self.failed}")
        if self.closed:
            raise WorkerError("the executor was shut down")

    def submit(self, plan: StepPlan) -> None:
        self._check_usable()
        if not self._submitted and not self.spec.pending_tokens:
            self._submitted += 1
            self.inline_step = plan.step_id
            self._run(plan, inline=True)
            return
        if self._thread is None:
            import torch

            self._thread = threading.Thread(
                target=self._loop, args=(torch.get_num_threads(),), name="medha-model", daemon=True
            )
            self._thread.start()
        self._submitted += 1
        self.inline_step = None
        self._jobs.put(plan)

    def _loop(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)  # the intra-op pool of this thread
        while (plan := self._jobs.get()) is not None:
            if not self._run(plan):
                return

    def _run(self, plan: StepPlan, inline: bool = False) -> bool:
        """Run one step in this thread and queue its result (False: it failed).

        ``inline`` (the caller's thread): a KeyboardInterrupt or SystemExit is
        recorded as the executor's failure and raised again."""
        t = time.perf_counter()
        try:
            result = self.runner.execute(plan)
        except BaseException as exc:
            self._results.put((plan.step_id, None, exc, 0.0))
            if inline and not isinstance(exc, Exception):
                self.failed = f"step {plan.step_id} interrupted: {type(exc).__name__}"
                raise
            return False
        self._results.put((plan.step_id, result, None, time.perf_counter() - t))
        return True

    def next_event(self) -> StepEvent:
        if not self._events:
            if self.failed is not None:  # its results stopped at the failed step
                raise WorkerError(f"the model failed earlier: {self.failed}")
            if not self._submitted:
                raise RuntimeError("next_event: no batch in flight")
            step_id, result, error, seconds = self._results.get()
            if error is not None:
                self.failed = f"step {step_id} failed: {type(error).__name__}: {error}"
                raise error
            self._events.append(StageCleared(step_id))
            # the one stage's own seconds: with batches queued behind each other
            # (async scheduling) submit-to-done also holds the wait for the previous one
            self._events.append(StepDone(step_id, [] if result is None else result, (seconds,)))
        event = self._events.popleft()
        if isinstance(event, StepDone):
            self._submitted -= 1
        return event

    def execute(self, plan: StepPlan) -> list[Sampled]:
        self._check_usable()
        if self._submitted:
            raise RuntimeError("execute: other batches are in flight")
        result = self.runner.execute(plan)
        return [] if result is None else result

    def shutdown(self) -> None:
        self.closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=10.0)
            self._thread = None


@dataclass
class _Pending:
    """A submitted batch: the ranks still owing a reply, the sampled rows once they come."""

    waiting: set[int]
    stage0: set[int]
    cleared: bool = False
    result: list[Sampled] = field(default_factory=list)
    stage_s: list[float] = field(default_factory=list)


class MultiprocExecutor:
    """One worker process per rank (see the module docstring).

    Args:
        spec: the layout and what every rank builds.
        start_timeout_s: bound on starting every worker and loading the model.
        step_timeout_s: bound on a wait in which no rank replies.
        join_timeout_s: how long shutdown waits before killing workers.
        poll_s: the longest single wait; a quiet one checks every worker is alive.
        stage0_first_s: with spp > 1 on the CPU, the longest the driver waits for
            stage 0's replies alone before it reads the later stages' too
            (:meth:`_wait_selector`); 0 reads every reply at once.
    """

    def __init__(
        self,
        spec: RunnerSpec,
        *,
        start_timeout_s: float = 600.0,
        step_timeout_s: float = 600.0,
        join_timeout_s: float = 10.0,
        poll_s: float = 0.2,
        stage0_first_s: float = 2e-3,
    ) -> None:
        import torch.multiprocessing as mp

        self.spec = spec
        self.stage0_first_s = stage0_first_s
        #: (newest step id, monotonic time) when the driver began waiting for stage 0
        #: alone on that step (:meth:`_wait_selector`)
        self._stage0_since: tuple[int, float] | None = None
        self.step_timeout_s = step_timeout_s
        self.join_timeout_s = join_timeout_s
        self.poll_s = poll_s
        self.closed = False
        self.failed: str | None = None
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._events: deque[StepEvent] = deque()
        self._selector: selectors.BaseSelector | None = None  # built by the first wait
        self._stage0_selector: selectors.BaseSelector | None = None  # see _wait_selector
        #: the sampling rank's compute time in the last step it finished (seconds)
        self.last_compute_s = 0.0
        #: set to a list to collect ``(step_id, rank, compute_s, cpu_s)`` per reply
        self.timings: list[tuple[int, int, float, float]] | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="medha-runtime-")
        init = f"file://{os.path.join(self._tmpdir, 'rendezvous')}"
        ctx = mp.get_context("forkserver")
        with contextlib.suppress(Exception):  # only effective before the forkserver starts
            ctx.set_forkserver_preload(["medha_runtime.worker"])
        from medha_runtime.worker import pipe_worker_main

        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(spec.world_size):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=pipe_worker_main,
                    args=(rank, spec, init, child),
                    name=f"medha-worker-{rank}",
                    daemon=True,
                )
                p.start()
                child.close()
                self.processes.append(p)
                self.conns.append(parent)
            ready = self._gather_ready(start_timeout_s)
            self.sampler_rank = next(r.rank for r in ready if r.sampler)
            self.stage0 = frozenset(r.rank for r in ready if r.stage == 0)
            self._stage_of = {r.rank: r.stage for r in ready}
            self._num_stages = 1 + max(self._stage_of.values())
            #: spp > 1 on the CPU: wait for stage 0 alone while it owes the newest
            #: batch and only later stages owe the oldest (:meth:`_wait_selector`)
            self._stage0_first = self._num_stages > 1 and resolve_device(spec.device) == "cpu"
        except BaseException:
            self._kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def submit(self, plan: StepPlan) -> None:
        """Send the plan to every worker (pickled once) and return."""
        check_usable(self)
        if plan.step_id in self._pending:
            raise ValueError(f"step {plan.step_id} is already in flight")
        message = pickle.dumps(Step(plan), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                write_message(conn, message)
            except (BrokenPipeError, EOFError, OSError) as exc:
                if not self.processes[rank].is_alive():
                    code = self._exitcode(rank)
                    self._fail(
                        f"worker rank {rank} died before step {plan.step_id} (exit code {code})"
                    )
                self._fail(f"worker rank {rank} is unreachable ({exc!r})")
        self._pending[plan.step_id] = _Pending(
            set(range(len(self.conns))), set(self.stage0), stage_s=[0.0] * self._num_stages
        )

    def next_event(self) -> StepEvent:
        """The next :class:`StageCleared` or :class:`StepDone`, or a WorkerError."""
        check_usable(self)
        if self._events:
            return self._events.popleft()
        if not self._pending:
            raise RuntimeError("next_event: no batch in flight")
        oldest = next(iter(self._pending))
        deadline = time.monotonic() + self.step_timeout_s
        while not self._events:
            selector, step_id, waiting, bound = self._wait_selector()
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(
                    f"step {step_id} timed out after {self.step_timeout_s:.0f}s waiting for "
                    f"ranks {sorted(waiting)}"
                )
            ready = selector.select(min(self.poll_s, left, bound))
            exited = not ready and bound >= self.poll_s  # a quiet poll_s: check every worker
            for key, _ in ready:
                rank, is_reply = key.data
                if is_reply:
                    self._on_reply(rank, self._recv(rank, f"step {oldest}"))
                else:
                    exited = True  # its process ended: read the replies first, then fail
            if ready:
                deadline = time.monotonic() + self.step_timeout_s
            if exited:
                self._check_alive(f"step {oldest}")
        return self._events.popleft()

    def _wait_selector(self) -> tuple[selectors.BaseSelector, int, set[int], float]:
        """What the next wait watches: ``(selector, step id, ranks it waits for, the
        longest it may last in seconds)``.

        Every rank's pipe, but for spp > 1 on the CPU while the oldest batch in
        flight has cleared stage 0 and the newest has not: then stage 0's pipes
        alone (and every process's sentinel), for up to :attr:`stage0_first_s`
        from the first such wait on the newest batch. So the oldest batch's end
        (its last stage's reply) is read once the newest clears stage 0, if that
        comes soon: a decode's stage here takes ~0.5 ms, while a long prefill
        chunk's stage takes tens of ms, beside which the driver's work weighs little.

        Read at once, that reply wakes the driver while stage 0 runs the newest
        batch, and where every core runs a rank the kernel often puts the driver on
        stage 0's core (the core it last ran on; 134 of 215 decode steps in one
        measured run): its ~0.1 ms of work (the oldest batch's outputs) then delays
        stage 0's forward pass, the pipeline's critical path (a decode's stage-0
        forward on tiny at 8K context: 0.45 ms alone, 0.6 ms with the driver beside
        it). Nothing is issued later: a batch after the newest waits for the newest
        to clear stage 0 anyway; only the oldest batch's outputs come later, by at
        most :attr:`stage0_first_s`.
        """
        pending = self._pending
        oldest = next(iter(pending))
        if self._stage0_first and len(pending) > 1:
            newest_id, newest = next(reversed(pending.items()))
            if pending[oldest].cleared and not newest.cleared:
                now = time.monotonic()
                since = self._stage0_since
                if since is None or since[0] != newest_id:
                    since = self._stage0_since = (newest_id, now)
                bound = since[1] + self.stage0_first_s - now
                if bound > 0:
                    if self._stage0_selector is None:
                        self._stage0_selector = self._make_selector(self.stage0)
                    return self._stage0_selector, newest_id, newest.stage0, bound
        if self._selector is None:
            self._selector = self._make_selector(range(len(self.conns)))
        return self._selector, oldest, pending[oldest].waiting, math.inf

    def _make_selector(self, ranks: Iterable[int]) -> selectors.BaseSelector:
        """A selector on the pipes of ``ranks`` (data ``(rank, True)``) and every
        worker's process sentinel (``(rank, False)``, readable once the process
        ended), so a wait notices a reply or a death at once, without polling every
        process."""
        selector = selectors.DefaultSelector()
        for rank in ranks:
            selector.register(self.conns[rank], selectors.EVENT_READ, (rank, True))
        for rank, p in enumerate(self.processes):
            selector.register(p.sentinel, selectors.EVENT_READ, (rank, False))
        return selector

    def execute(self, plan: StepPlan) -> list[Sampled]:
        """Run one step with nothing else in flight; the sampled rows in plan order."""
        if self._pending:
            raise RuntimeError("execute: other batches are in flight")
        self.submit(plan)
        while True:
            event = self.next_event()
            if isinstance(event, StepDone):
                return event.result

    def _recv(self, rank: int, what: str) -> Any:
        try:
            return pickle.loads(read_message(self.conns[rank]))
        except (EOFError, OSError):
            code = self._exitcode(rank)
            self._fail(f"worker rank {rank} died during {what} (exit code {code})")

    def _on_reply(self, rank: int, msg: Any) -> None:
        if isinstance(msg, Failed):
            self._fail_after_peer(rank, msg.error)
        if not isinstance(msg, Done) or msg.step_id not in self._pending:
            self._fail(f"worker rank {rank} sent {msg!r}, which answers no step in flight")
        pend = self._pending[msg.step_id]
        if self.timings is not None:
            self.timings.append((msg.step_id, rank, msg.compute_s, msg.cpu_s))
        pend.waiting.discard(rank)
        pend.stage0.discard(rank)
        stage = self._stage_of[rank]
        pend.stage_s[stage] = max(pend.stage_s[stage], msg.compute_s - msg.wait_s)
        if rank == self.sampler_rank:
            self.last_compute_s = msg.compute_s
            if msg.result is not None:
                pend.result = msg.result
        if not pend.cleared and not pend.stage0:
            pend.cleared = True
            self._events.append(StageCleared(msg.step_id))
        while self._pending:
            step_id, first = next(iter(self._pending.items()))
            if first.waiting:
                break
            del self._pending[step_id]
            self._events.append(StepDone(step_id, first.result, tuple(first.stage_s)))

    def _gather_ready(self, timeout_s: float) -> list[Ready]:
        """A :class:`Ready` from every worker, or a WorkerError."""
        what = (
            "starting the workers (their stderr has details; a script that starts "
            "workers needs an `if __name__ == '__main__':` guard)"
        )
        replies: dict[int, Ready] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.conns):
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(set(range(len(self.conns))) - set(replies))
                self._fail(f"{what} timed out after {timeout_s:.0f}s waiting for ranks {ranks}")
            pending = [c for r, c in enumerate(self.conns) if r not in replies]
            for conn in wait(pending, timeout=min(self.poll_s, left)):
                rank = self.conns.index(conn)  # type: ignore[arg-type]
                msg = self._recv(rank, what)
                if isinstance(msg, Failed):
                    self._fail(f"{what}: {msg.error}")
                if not isinstance(msg, Ready):
                    self._fail(f"{what}: worker rank {rank} sent {msg!r} before Ready")
                replies[rank] = msg
            self._check_alive(what, skip=set(replies))
        return [replies[r] for r in range(len(self.conns))]

    def _check_alive(self, what: str, skip: frozenset[int] | set[int] = frozenset()) -> None:
        for rank, p in enumerate(self.processes):
            if rank not in skip and not p.is_alive():
                code = self._exitcode(rank)
                self._fail(f"worker rank {rank} died during {what} (exit code {code})")

    def check_workers(self) -> None:
        """Notice a worker that died between steps: set :attr:`failed`, kill the rest."""
        if self.failed is not None or self.closed:
            return
        for rank, p in enumerate(self.processes):
            if not p.is_alive():
                self.failed = f"worker rank {rank} died (exit code {p.exitcode})"
                self._kill()
                return

    def _fail_after_peer(self, rank: int, error: str) -> NoReturn:
        """Rank ``rank`` failed with ``error``; if another worker is dead, name it
        first: a survivor's failed collective is the death's consequence, and its
        reply can arrive before the dead worker's closed pipe is read, and even
        before the dead process is reaped (seen on a 16-core machine: rank 0's gloo
        error named no dead peer). So every other rank is polled for up to
        ``PEER_DEATH_WAIT_S``: with all of them healthy this error comes that late."""
        deadline = time.monotonic() + PEER_DEATH_WAIT_S
        while True:
            for other, p in enumerate(self.processes):
                if other != rank and not p.is_alive():
                    code = self._exitcode(other)
                    self._fail(
                        f"worker rank {other} died (exit code {code}); rank {rank} then "
                        f"failed: {error}"
                    )
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self._fail(error)

    def _exitcode(self, rank: int) -> int | None:
        p = self.processes[rank]
        p.join(timeout=1.0)
        return p.exitcode

    def _fail(self, message: str) -> NoReturn:
        self.failed = message
        self._kill()
        raise WorkerError(message)

    def _kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(timeout=5.0)
        self._close()

    def _close(self) -> None:
        self.closed = True
        for selector in (self._selector, self._stage0_selector):
            if selector is not None:
                with contextlib.suppress(Exception):
                    selector.close()
        self._selector = self._stage0_selector = None
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def shutdown(self) -> None:
        """Stop every worker: a shutdown message, a bounded join, then kill."""
        if self.closed:
            return
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(Shutdown())
        join_or_kill(self.processes, self.join_timeout_s)
        self._close()


def join_or_kill(processes: list[Any], timeout_s: float) -> None:
    """Join ``processes`` within ``timeout_s`` in all, then kill whatever still runs."""
    deadline = time.monotonic() + timeout_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def make_executor(
    spec: RunnerSpec, *, distributed: DistConfig | None = None, **kwargs: Any
) -> Executor:
    """In-process for one rank; with ``distributed`` (a
    :class:`~medha_runtime.dist_config.DistConfig`: multi-node or torchrun) a
    :class:`~medha_runtime.dist_executor.DistributedExecutor` whose driver is
    rank 0; otherwise one worker process per rank on this node."""
    if distributed is not None:
        from medha_runtime.dist_executor import DistributedExecutor

        return DistributedExecutor(spec, distributed, **kwargs)
    if spec.world_size == 1:
        return InProcessExecutor(spec)
    return MultiprocExecutor(spec, **kwargs)
