"""The multi-node (and torchrun) executor: the driver process is itself rank 0.

:class:`DistributedExecutor` joins the ``torch.distributed`` world as rank 0
through ``env://`` (see :mod:`medha_runtime.dist_config`), starts the other
ranks of its own node as worker processes (:mod:`medha_runtime.dist_worker`;
ranks on other nodes are started there by ``medha-runtime serve --node-rank R``
or by torchrun), and broadcasts the :class:`~medha_runtime.runner.RunnerSpec`
over a gloo control group. Every other rank runs the one worker loop
(:func:`medha_runtime.worker.serve`) over
:class:`~medha_runtime.transport.DistTransport`. Then each step:

1. a :class:`~medha_runtime.messages.Step` is broadcast from rank 0 over the
   control group;
2. rank 0 runs its share in this process (its own ``ModelRunner``) while the
   other ranks run theirs (the collectives inside the model line up);
3. if the sampling rank is not rank 0 it sends its
   :class:`~medha_runtime.messages.Done` (the sampled rows) to rank 0 over the
   control group.

Steps run one at a time here (:meth:`~DistributedExecutor.submit` returns
once the step is done): the driver's own rank works in the driver's thread,
so a second batch cannot enter stage 0 while it runs.

While idle the driver broadcasts a keepalive every ``keepalive_s`` from a
background thread (steps and keepalives never overlap: one lock). A worker
or peer that dies makes the next step, or the next keepalive, fail with a
:class:`~medha_runtime.executor.WorkerError` (:attr:`DistributedExecutor.failed`
is set either way); a dead driver ends every worker (exit status 1).
:meth:`~DistributedExecutor.shutdown` broadcasts a shutdown message: every
worker exits with status 0.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from medha_runtime.dist_config import (
    DistConfig,
    build_rank,
    join_world,
    leave_world,
    set_threads,
)
from medha_runtime.dist_worker import start_workers
from medha_runtime.executor import SyncEvents, WorkerError, join_or_kill
from medha_runtime.messages import Done, Failed, Ping, Shutdown, Step, ToWorker
from medha_runtime.plan import StepPlan
from medha_runtime.runner import RunnerSpec
from medha_runtime.sampling import Sampled


class DistributedExecutor(SyncEvents):
    """Rank 0 of a ``torch.distributed`` world (see the module docstring).

    Args:
        spec: the layout and what every rank builds; ``spec.world_size`` must
            equal ``config.world_size``.
        config: the rendezvous, the ranks of this node and the timeouts.
        join_timeout_s: how long shutdown waits for this node's workers.
    """

    def __init__(self, spec: RunnerSpec, config: DistConfig, *, join_timeout_s: float = 10.0):
        if spec.world_size != config.world_size:
            raise ValueError(
                f"the layout tp*spp*kvp={spec.world_size} does not match the distributed "
                f"world size {config.world_size}"
            )
        super().__init__()
        self.spec, self.config = spec, config
        self.join_timeout_s = join_timeout_s
        self.failed: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None
        local = range(1, config.local_ranks if config.start_local else 1)
        self.processes = start_workers(
            config, local, node_first_rank=0, local_world=config.local_ranks
        )
        try:
            self._start()
        except BaseException:
            self.failed = "start-up failed"
            self._close()
            raise

    def _start(self) -> None:
        import torch.distributed as dist

        cfg = self.config
        print(
            f"medha-runtime: rank 0 waiting for {cfg.world_size} ranks at "
            f"{cfg.master_addr}:{cfg.master_port} (at most {cfg.start_timeout_s:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        self.control = join_world(cfg, rank=0, local_rank=0)
        dist.broadcast_object_list([self.spec], src=0, group=self.control)
        set_threads(self.spec, cfg.local_ranks)
        _, self.runner, error = build_rank(self.spec)
        info = {"rank": 0, "sampler": self.runner is not None and self.runner.is_sampler}
        infos: list[Any] = [None] * cfg.world_size
        dist.gather_object({**info, "error": error}, infos, dst=0, group=self.control)
        for i in infos:
            if i["error"] is not None:
                raise WorkerError(f"rank {i['rank']} failed to start:\n{i['error']}")
        self.sampler_rank = next(i["rank"] for i in infos if i["sampler"])
        self._thread = threading.Thread(target=self._keepalive, name="medha-keepalive")
        self._thread.daemon = True
        self._thread.start()

    def _send(self, msg: ToWorker) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([msg], src=0, group=self.control)
        self._last = time.monotonic()

    def _run(self, plan: StepPlan) -> list[Sampled] | None:
        """Run one step on every rank; return the sampled rows in plan order."""
        import torch.distributed as dist

        if self.failed is not None:
            raise WorkerError(f"the workers failed earlier: {self.failed}")
        if self.closed:
            raise WorkerError("the executor was shut down")
        with self._lock:
            try:
                self._send(Step(plan))
                result = self.runner.execute(plan)
                if self.sampler_rank != 0:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, src=self.sampler_rank, group=self.control)
                    reply = box[0]
                    if isinstance(reply, Failed):
                        self.failed = f"step {plan.step_id} failed: {reply.error}"
                        raise WorkerError(self.failed)
                    if not isinstance(reply, Done) or reply.step_id != plan.step_id:
                        raise RuntimeError(f"the sampling rank answered {reply!r}")
                    result = reply.result
            except WorkerError:
                raise
            except Exception as exc:
                self.failed = (
                    f"step {plan.step_id} failed: {type(exc).__name__}: {exc} (a worker rank "
                    "died or failed: its stderr, on its node, has details)"
                )
                raise WorkerError(self.failed) from None
        return result

    def _keepalive(self) -> None:
        period = self.config.keepalive_s
        while not self._stop.wait(min(period, 0.5)):
            self.check_workers()
            if self.failed is not None:
                return
            if time.monotonic() - self._last < period or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._stop.is_set() and self.failed is None:
                    self._send(Ping())
            except Exception as exc:
                self.failed = f"a worker rank is gone: {type(exc).__name__}: {exc}"
                return
            finally:
                self._lock.release()

    def check_workers(self) -> None:
        """Notice a worker process on this node that exited (sets :attr:`failed`)."""
        if self.failed is not None:
            return
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            self.failed = f"worker {dead[0].name} exited with code {dead[0].exitcode}"

    def shutdown(self) -> None:
        """Tell every rank to exit, wait for this node's workers, leave the world."""
        if self.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.control_timeout_s)
        if self.failed is None:
            with self._lock:
                try:
                    self._send(Shutdown())
                except Exception as exc:
                    self.failed = f"shutdown: {type(exc).__name__}: {exc}"
        self._close()

    def _close(self) -> None:
        self.closed = True
        join_or_kill(self.processes, self.join_timeout_s if self.failed is None else 0.0)
        leave_world()
