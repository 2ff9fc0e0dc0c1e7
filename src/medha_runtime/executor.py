"""Executors: run :class:`~medha_runtime.plan.StepPlan` s on one process or on one
process per rank.

- :class:`InProcessExecutor` (world size 1): a :class:`~medha_runtime.runner.ModelRunner`
  in the caller's process; no worker, no ``torch.distributed``.
- :class:`MultiprocExecutor` (world size > 1): one worker process per rank,
  started with ``torch.multiprocessing``'s forkserver method, joined into one
  ``torch.distributed`` group (gloo on CPUs, NCCL on GPUs) through a
  ``file://`` rendezvous in a private temporary directory. The driver (the
  caller's process; it is no rank) owns the scheduler and talks to each
  worker over its own ``multiprocessing`` pipe (pickled plain data, no extra
  dependency): it sends every step's plan to every worker and waits for every
  worker's reply; the sampling rank's reply carries the sampled tokens.

  Failures surface as :class:`WorkerError` in the driver, never as a hang:
  a worker that raises sends its traceback; a worker that dies is seen
  through its process sentinel within ``poll_s``; a step that takes longer
  than ``step_timeout_s`` fails. Ranks blocked in a collective with a dead
  peer give up after the collective timeout (``RunnerSpec.timeout_s``). After
  a failure every worker is killed and the executor refuses further steps.

  :meth:`MultiprocExecutor.shutdown` sends a shutdown message, joins the
  workers (``join_timeout_s``), kills stragglers and removes the temporary
  directory. Workers are daemonic, so they also die with the driver, and a
  worker whose pipe closes exits by itself.

- :class:`~medha_runtime.dist_executor.DistributedExecutor` (several nodes, or
  torchrun): the driver is rank 0 of an ``env://`` world; see
  :func:`make_executor`.

Batches are not overlapped: a step is issued to every rank and its results
are awaited before the next step is formed (SPP stages therefore work one
batch at a time in this version).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, Protocol

from medha_runtime.dist_config import DistConfig, set_threads
from medha_runtime.plan import StepPlan
from medha_runtime.runner import ModelRunner, RunnerSpec
from medha_runtime.sampling import Sampled


class WorkerError(RuntimeError):
    """A worker failed, died or timed out; the executor is unusable afterwards."""


class Executor(Protocol):
    spec: RunnerSpec
    #: why the workers can run no more steps, or None
    failed: str | None

    def execute(self, plan: StepPlan) -> list[Sampled]:
        """Run one step on every rank; return the sampled rows in plan order."""
        ...

    def check_workers(self) -> None:
        """Between steps: notice a worker that died (sets :attr:`failed`)."""
        ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """The whole model in the caller's process (tp = spp = kvp = 1)."""

    def __init__(self, spec: RunnerSpec) -> None:
        if spec.world_size != 1:
            raise ValueError(f"InProcessExecutor runs one rank, the layout has {spec.world_size}")
        self.spec = spec
        self.runner = ModelRunner(spec)
        self.closed = False
        self.failed: str | None = None  # no workers to lose

    def check_workers(self) -> None:
        """Nothing to check: the model runs in this process."""

    def execute(self, plan: StepPlan) -> list[Sampled]:
        if self.closed:
            raise WorkerError("the executor was shut down")
        result = self.runner.execute(plan)
        return [] if result is None else result

    def shutdown(self) -> None:
        self.closed = True


def _worker_main(rank: int, spec: RunnerSpec, init_method: str, conn: Connection) -> None:
    """A worker process: join the group, build the rank's runner, serve plans until told to stop."""
    import torch

    state = None
    try:
        set_threads(spec, spec.world_size)
        from medha_parallel import ParallelLayout, ParallelState
        from medha_runtime.runner import resolve_device

        if resolve_device(spec.device) == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        layout = ParallelLayout(tp=spec.tp, spp=spec.spp, kvp=spec.kvp)
        state = ParallelState.initialize(
            layout,
            init_method=init_method,
            rank=rank,
            world_size=spec.world_size,
            timeout_s=spec.timeout_s,
        )
        runner = ModelRunner(spec, state)
        conn.send(("ready", {"rank": rank, "pid": os.getpid(), "sampler": runner.is_sampler}))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank} failed to start:\n{traceback.format_exc()}"))
        _destroy(state)
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the driver is gone
            if msg[0] == "shutdown":
                break
            try:
                result = runner.execute(msg[1])
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.send(("error", f"rank {rank} failed:\n{traceback.format_exc()}"))
                break
            conn.send(("ok", result))
    finally:
        _destroy(state)
        with contextlib.suppress(Exception):
            conn.close()


def _destroy(state: Any) -> None:
    if state is not None:
        with contextlib.suppress(Exception):
            state.destroy()


class MultiprocExecutor:
    """One worker process per rank (see the module docstring).

    Args:
        spec: the layout and what every rank builds.
        start_timeout_s: bound on starting every worker and loading the model.
        step_timeout_s: bound on one step.
        join_timeout_s: how long shutdown waits before killing workers.
        poll_s: how often a wait checks that every worker is still alive.
    """

    def __init__(
        self,
        spec: RunnerSpec,
        *,
        start_timeout_s: float = 600.0,
        step_timeout_s: float = 600.0,
        join_timeout_s: float = 10.0,
        poll_s: float = 0.2,
    ) -> None:
        import torch.multiprocessing as mp

        self.spec = spec
        self.step_timeout_s = step_timeout_s
        self.join_timeout_s = join_timeout_s
        self.poll_s = poll_s
        self.closed = False
        self.failed: str | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="medha-runtime-")
        init = f"file://{os.path.join(self._tmpdir, 'rendezvous')}"
        ctx = mp.get_context("forkserver")
        with contextlib.suppress(Exception):  # only effective before the forkserver starts
            ctx.set_forkserver_preload(["medha_runtime.executor"])
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(spec.world_size):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(
                    target=_worker_main,
                    args=(rank, spec, init, child),
                    name=f"medha-worker-{rank}",
                    daemon=True,
                )
                p.start()
                child.close()
                self.processes.append(p)
                self.conns.append(parent)
            infos = self._gather(
                start_timeout_s,
                "starting the workers (their stderr has details; a script that starts "
                "workers needs an `if __name__ == '__main__':` guard)",
            )
            self.sampler_rank = next(r for r, info in enumerate(infos) if info["sampler"])
        except BaseException:
            self._kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def execute(self, plan: StepPlan) -> list[Sampled]:
        if self.failed is not None:
            raise WorkerError(f"the workers failed earlier: {self.failed}")
        if self.closed:
            raise WorkerError("the executor was shut down")
        message = pickle.dumps(("step", plan), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)  # pickled once for every rank
            except (BrokenPipeError, EOFError, OSError) as exc:
                if not self.processes[rank].is_alive():
                    code = self._exitcode(rank)
                    self._fail(
                        f"worker rank {rank} died before step {plan.step_id} (exit code {code})"
                    )
                self._fail(f"worker rank {rank} is unreachable ({exc!r})")
        results = self._gather(self.step_timeout_s, f"step {plan.step_id}")
        result = results[self.sampler_rank]
        return [] if result is None else result

    def _gather(self, timeout_s: float, what: str) -> list[Any]:
        """One reply from every worker, or a WorkerError."""
        replies: dict[int, Any] = {}
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(pending)
                self._fail(f"{what} timed out after {timeout_s:.0f}s waiting for ranks {ranks}")
            ready = wait(list(pending.values()), timeout=min(self.poll_s, left))
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    code = self._exitcode(rank)
                    self._fail(f"worker rank {rank} died during {what} (exit code {code})")
                if kind == "error":
                    self._fail(f"{what}: {payload}")
                replies[rank] = payload
                del pending[rank]
            for rank in pending:
                if not self.processes[rank].is_alive():
                    code = self._exitcode(rank)
                    self._fail(f"worker rank {rank} died during {what} (exit code {code})")
        return [replies[r] for r in range(len(self.conns))]

    def check_workers(self) -> None:
        """Notice a worker that died between steps: set :attr:`failed`, kill the rest."""
        if self.failed is not None or self.closed:
            return
        for rank, p in enumerate(self.processes):
            if not p.is_alive():
                self.failed = f"worker rank {rank} died (exit code {p.exitcode})"
                self._kill()
                return

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
                conn.send(("shutdown", None))
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
