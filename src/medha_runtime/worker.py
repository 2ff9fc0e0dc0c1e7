"""The worker loop every rank runs, whatever carries its messages.

:func:`serve` takes a built :class:`~medha_runtime.runner.ModelRunner` and a
:class:`~medha_runtime.transport.WorkerTransport` and answers the driver's
messages (:mod:`medha_runtime.messages`) in order until told to stop:

- :class:`~medha_runtime.messages.Step`: run the plan, reply
  :class:`~medha_runtime.messages.Done` (the sampling rank's carries the
  sampled rows), or :class:`~medha_runtime.messages.Failed` with the
  traceback and stop; then, over a pipe with no message waiting, let the
  runner build the next decode step's batch ahead
  (:meth:`~medha_runtime.runner.ModelRunner.prepare_next`; a failure there is
  logged once and ends building ahead on that rank, the steps go on);
- :class:`~medha_runtime.messages.Ping`: nothing;
- :class:`~medha_runtime.messages.Shutdown`: stop (status 0).

A closed transport (the driver is gone) stops the loop with status 1.

:func:`pipe_worker_main` is one worker process of a
:class:`~medha_runtime.executor.MultiprocExecutor`: it joins the group through
a ``file://`` rendezvous, builds the rank's runner, says
:class:`~medha_runtime.messages.Ready` and serves over its pipe. The
multi-node ranks (:mod:`medha_runtime.dist_worker`) serve the same loop over
:class:`~medha_runtime.transport.DistTransport`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from medha_runtime.messages import Done, Failed, Ping, Ready, Shutdown, Step
from medha_runtime.transport import PipeTransport, TransportClosed, WorkerTransport

logger = logging.getLogger(__name__)


def serve(runner: Any, transport: WorkerTransport, *, rank: int) -> int:
    """Answer the driver until a shutdown (returns 0) or a failure (returns 1).

    Over a transport that tells whether a message waits (``pending``), a rank with
    nothing waiting after its reply lets the runner build the next decode step's
    batch ahead (``prepare_next``), while the driver turns the step around; it
    passes ``pending`` as ``stop``, asked again before the build's costlier half. A
    build that raises is dropped (the next step builds its own batch): its traceback
    is logged as a warning and the rank builds nothing ahead from then on.
    """
    prepare = getattr(runner, "prepare_next", None)
    pending = getattr(transport, "pending", None)
    if not callable(pending):
        prepare = None
    while True:
        try:
            msg = transport.recv()
        except TransportClosed:
            return 1
        if isinstance(msg, Shutdown):
            return 0
        if isinstance(msg, Ping):
            continue
        if not isinstance(msg, Step):
            _reply(transport, Failed(rank, f"rank {rank}: unknown message {msg!r}"))
            return 1
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            result = runner.execute(msg.plan)
        except BaseException:
            error = f"rank {rank} failed in step {msg.plan.step_id}:\n{traceback.format_exc()}"
            _reply(transport, Failed(rank, error))
            return 1
        seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        pipeline = getattr(runner, "pipeline", None)
        wait = 0.0
        if pipeline is not None:  # a later stage: its wait for the previous stage is not its work
            wait, cpu = pipeline.wait_s, cpu - pipeline.wait_cpu_s
            # stage 0 with async scheduling: its wait for the last stage's tokens
            wait += getattr(runner, "token_wait_s", 0.0)
            cpu -= getattr(runner, "token_wait_cpu_s", 0.0)
        done = Done(rank, msg.plan.step_id, result, seconds, cpu, wait)
        if not _reply(transport, done):
            return 1
        if prepare is not None and not pending():
            # idle until the driver's next step: build its batch ahead (a decode step's)
            try:
                prepare(stop=pending)
            except Exception:  # a bug, not the step's: it builds its own batch
                logger.warning(
                    "rank %d failed building the step after %d ahead; it builds no "
                    "batch ahead from now on",
                    rank,
                    msg.plan.step_id,
                    exc_info=True,
                )
                prepare = None


def _reply(transport: WorkerTransport, msg: Done | Failed) -> bool:
    try:
        transport.send(msg)
    except TransportClosed:
        return False
    return True


def pipe_worker_main(rank: int, spec: Any, init_method: str, conn: Connection) -> None:
    """One worker process: join the group, build the rank's runner, serve the pipe."""
    import torch

    from medha_runtime.dist_config import set_threads

    transport = PipeTransport(conn)
    state = None
    try:
        set_threads(spec, spec.world_size)
        from medha_parallel import ParallelLayout, ParallelState
        from medha_runtime.runner import ModelRunner, resolve_device

        device = resolve_device(spec.device)
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        layout = ParallelLayout(tp=spec.tp, spp=spec.spp, kvp=spec.kvp)
        state = ParallelState.initialize(  # CPU ranks on gloo even on a CUDA machine
            layout,
            init_method=init_method,
            rank=rank,
            world_size=spec.world_size,
            device=device,
            timeout_s=spec.timeout_s,
        )
        runner = ModelRunner(spec, state)
        transport.send(Ready(rank, os.getpid(), runner.stage, runner.is_sampler))
    except BaseException:
        _reply(transport, Failed(rank, f"rank {rank} failed to start:\n{traceback.format_exc()}"))
        _destroy(state)
        return
    try:
        serve(runner, transport, rank=rank)
    finally:
        _destroy(state)
        with contextlib.suppress(Exception):
            conn.close()


def _destroy(state: Any) -> None:
    if state is not None:
        with contextlib.suppress(Exception):
            state.destroy()
