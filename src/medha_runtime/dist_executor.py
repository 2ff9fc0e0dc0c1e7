"""The multi-node (and torchrun) executor: the driver process is itself rank 0.

:class:`DistributedExecutor` joins the ``torch.distributed`` world as rank 0
at its rendezvous (see :mod:`medha_runtime.dist_config`), starts the other
ranks of its own node as worker processes (:mod:`medha_runtime.dist_worker`;
ranks on other nodes are started there by ``medha-runtime serve --node-rank R``
or by torchrun), and broadcasts the :class:`~medha_runtime.runner.RunnerSpec`
(on the default group, within the start bound; the steps then travel on a gloo
control group). Every other rank runs the one worker loop
(:func:`medha_runtime.worker.serve`) over
:class:`~medha_runtime.transport.DistTransport`. Then each step:

1. :meth:`~DistributedExecutor.submit` posts a
   :class:`~medha_runtime.messages.Step` to every other rank, point to point
   (:func:`~medha_runtime.transport.post_object`: it returns at once, and a
   rank still busy with an earlier step reads it when it is done), hands the
   plan to rank 0's model thread and returns;
2. rank 0 runs its share on that thread (its own ``ModelRunner``) while the
   other ranks run theirs (the collectives inside the model line up); when it
   is done the batch has left pipeline stage 0 (rank 0 is on stage 0):
   :class:`~medha_runtime.executor.StageCleared`;
3. the sampling rank's :class:`~medha_runtime.messages.Done` (the sampled
   rows; a reply thread receives it when the sampler is not rank 0) makes
   :class:`~medha_runtime.executor.StepDone`. With SPP > 1 every other rank
   posts its :class:`~medha_runtime.messages.Done` too (its times, no rows;
   it does not wait for rank 0 to take it), and the reply thread takes one
   from each rank per step: ``StepDone.stage_s`` holds, per stage, the
   slowest rank's own seconds (``compute_s - wait_s``; rank 0 times its
   share itself), as :class:`~medha_runtime.executor.MultiprocExecutor`
   reports them, so the engine's cost model learns the stage-sum latency.
   With SPP = 1 ``stage_s`` holds rank 0's own seconds (async scheduling
   learns from them: a batch waits behind the previous one after its submit).

So the engine's stream pipelining works across nodes as it does in one:
up to ``spp`` batches are in flight, and the next chunk of a prompt enters
stage 0 while the previous one runs on the later stages.

While idle the driver posts a keepalive every ``keepalive_s`` from a
background thread (posts from the threads never interleave: one lock). A worker
or peer that dies makes the next step, or the next keepalive, fail with a
:class:`~medha_runtime.executor.WorkerError` (:attr:`DistributedExecutor.failed`
is set either way); a dead driver ends every worker (exit status 1).
:meth:`~DistributedExecutor.shutdown` broadcasts a shutdown message: every
worker exits with status 0.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from medha_runtime.dist_config import (
    DistConfig,
    build_rank,
    join_world,
    leave_world,
    rendezvous_env,
    restore_env,
    set_threads,
)
from medha_runtime.dist_worker import start_workers
from medha_runtime.executor import (
    StageCleared,
    StepDone,
    StepEvent,
    WorkerError,
    check_usable,
    join_or_kill,
)
from medha_runtime.messages import Done, Failed, Ping, Shutdown, Step, ToWorker
from medha_runtime.plan import StepPlan
from medha_runtime.runner import RunnerSpec
from medha_runtime.sampling import Sampled
from medha_runtime.transport import Posted, post_object, reap, recv_object

#: how often a blocked :meth:`DistributedExecutor.next_event` looks for dead local workers
_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class _Cleared:
    """Rank 0 finished its share of ``step_id`` in ``own_s`` seconds (without
    waiting for a previous stage); ``result``: its sampled rows if it samples."""

    step_id: int
    result: list[Sampled] | None
    own_s: float


@dataclass(frozen=True, slots=True)
class _Replies:
    """What the reply thread received for ``step_id``, one message per rank it hears."""

    step_id: int
    replies: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Broken:
    """A thread of the driver cannot go on: ``why``."""

    why: str


#: what the driver's threads report to :meth:`DistributedExecutor.next_event`
_Report = _Cleared | _Replies | _Broken


class DistributedExecutor:
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
        if spec.pending_tokens and spec.spp > 1:
            raise ValueError(
                f"async scheduling (pending_tokens) with spp={spec.spp} (tp={spec.tp}, "
                f"kvp={spec.kvp}) needs worker processes on one host; the torch.distributed "
                "executor runs it with spp = 1 only"
            )
        self.spec, self.config = spec, config
        self.join_timeout_s = join_timeout_s
        self.failed: str | None = None
        self.closed = False
        self._lock = threading.Lock()  # posts to the other ranks, from any thread
        self._stop = threading.Event()
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None
        self._posted: deque[Posted] = deque()
        self._jobs: queue.SimpleQueue[StepPlan | None] = queue.SimpleQueue()
        self._expect: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._out: queue.SimpleQueue[_Report] = queue.SimpleQueue()
        self._events: deque[StepEvent] = deque()
        self._order: deque[int] = deque()  # step ids in flight, oldest first
        self._cleared: dict[int, _Cleared] = {}  # rank 0 done, the replies not yet taken
        self._early: dict[int, _Replies] = {}  # the replies before rank 0 cleared the step
        self._threads: list[threading.Thread] = []
        self._env = rendezvous_env()  # join_world sets it; _close puts it back
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
        import torch
        import torch.distributed as dist

        cfg = self.config
        print(
            f"medha-runtime: rank 0 waiting for {cfg.world_size} ranks at "
            f"{cfg.master_addr}:{cfg.master_port} (at most {cfg.start_timeout_s:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        self.control = join_world(cfg, rank=0, local_rank=0)
        # start-up (every rank builds its model) on the default group: the start bound
        dist.broadcast_object_list([self.spec], src=0)
        set_threads(self.spec, cfg.local_ranks)
        _, self.runner, error = build_rank(self.spec)
        info = {
            "rank": 0,
            "sampler": self.runner is not None and self.runner.is_sampler,
            "stage": None if self.runner is None else self.runner.stage,
        }
        infos: list[Any] = [None] * cfg.world_size
        dist.gather_object({**info, "error": error}, infos, dst=0)
        for i in infos:
            if i["error"] is not None:
                raise WorkerError(f"rank {i['rank']} failed to start:\n{i['error']}")
        self.sampler_rank = next(i["rank"] for i in infos if i["sampler"])
        #: each rank's pipeline stage; with SPP > 1 every other rank replies (its times)
        self._stage_of = {i["rank"]: i["stage"] for i in infos}
        self._timed = self.spec.spp > 1
        others = range(1, cfg.world_size) if self._timed else (self.sampler_rank,)
        self._reply_ranks = tuple(r for r in others if r != 0)
        self._spawn(self._model_loop, "medha-rank0", torch.get_num_threads())
        if self._reply_ranks:
            self._spawn(self._reply_loop, "medha-replies")
        self._thread = self._spawn(self._keepalive, "medha-keepalive")

    def _spawn(self, target: Any, name: str, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    # ------------------------------------------------------------------ posts
    def _post(self, msg: ToWorker) -> None:
        """Post ``msg`` to every other rank (non-blocking; raises a failed earlier post)."""
        with self._lock:
            reap(self._posted)
            for rank in range(1, self.config.world_size):
                self._posted.append(post_object(msg, rank, self.control))
            self._last = time.monotonic()

    def _drain_posts(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every post to be delivered."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._posted and time.monotonic() < deadline:
                reap(self._posted)
                time.sleep(0.01)

    # ---------------------------------------------------------------- threads
    def _model_loop(self, threads: int) -> None:
        """Rank 0's share of each step, in order, on its own thread."""
        import torch

        torch.set_num_threads(threads)  # this thread's intra-op pool
        pipeline = getattr(self.runner, "pipeline", None)
        while (plan := self._jobs.get()) is not None:
            t0 = time.perf_counter()
            try:
                result = self.runner.execute(plan)
            except BaseException as exc:
                why = f"step {plan.step_id} failed on rank 0: {type(exc).__name__}: {exc}"
                self._out.put(_Broken(why))
                return
            wait = pipeline.wait_s if pipeline is not None else 0.0
            self._out.put(_Cleared(plan.step_id, result, time.perf_counter() - t0 - wait))

    def _reply_loop(self) -> None:
        """Each step's answers, in order: the sampling rank's (it is not rank 0) and,
        with SPP > 1, every other rank's (their times)."""
        while (step_id := self._expect.get()) is not None:
            replies = []
            for rank in self._reply_ranks:
                try:
                    reply = recv_object(rank, self.control)
                except Exception as exc:
                    role = "the sampling rank" if rank == self.sampler_rank else "rank"
                    why = (
                        f"step {step_id} failed: no answer from {role} {rank} "
                        f"({type(exc).__name__}: {exc}; a worker rank died or failed: its "
                        "stderr, on its node, has details)"
                    )
                    self._out.put(_Broken(why))
                    return
                replies.append(reply)
                if isinstance(reply, Failed):
                    break
            self._out.put(_Replies(step_id, tuple(replies)))

    # ------------------------------------------------------------------ steps
    @property
    def in_flight(self) -> int:
        """Batches submitted whose :class:`StepDone` was not yet returned."""
        return len(self._order)

    def submit(self, plan: StepPlan) -> None:
        """Post the step to every rank, start rank 0's share, and return."""
        check_usable(self)
        try:
            self._post(Step(plan))
        except Exception as exc:
            self._fail(f"step {plan.step_id}: a worker rank is gone ({type(exc).__name__}: {exc})")
        self._order.append(plan.step_id)
        self._jobs.put(plan)
        if self._reply_ranks:
            self._expect.put(plan.step_id)

    def next_event(self) -> StepEvent:
        """The next :class:`StageCleared` or :class:`StepDone` (blocking), in order."""
        while not self._events:
            if not self._order:
                raise RuntimeError("next_event: no batch in flight")
            check_usable(self)
            try:
                item = self._out.get(timeout=_POLL_S)
            except queue.Empty:
                self.check_workers()
                continue
            self._take(item)
        event = self._events.popleft()
        if isinstance(event, StepDone):
            if event.step_id != self._order[0]:
                self._fail(f"step {event.step_id} ended before step {self._order[0]}")
            self._order.popleft()
        return event

    def _take(self, item: _Report) -> None:
        """Turn one thread report into events (the replies wait for their StageCleared)."""
        if isinstance(item, _Broken):
            self._fail(item.why)
        if isinstance(item, _Cleared):
            self._events.append(StageCleared(item.step_id))
            if not self._reply_ranks:
                self._events.append(self._step_done(item, _Replies(item.step_id, ())))
            elif (early := self._early.pop(item.step_id, None)) is not None:
                self._events.append(self._step_done(item, early))
            else:
                self._cleared[item.step_id] = item
            return
        for reply in item.replies:
            if isinstance(reply, Failed):
                self._fail(f"a step failed: {reply.error}")
            if not isinstance(reply, Done) or reply.step_id != item.step_id:
                self._fail(f"a worker rank answered step {item.step_id} with {reply!r}")
        if (cleared := self._cleared.pop(item.step_id, None)) is not None:
            self._events.append(self._step_done(cleared, item))
        else:
            self._early[item.step_id] = item

    def _step_done(self, cleared: _Cleared, replies: _Replies) -> StepDone:
        """The step's sampled rows and, with SPP > 1, its per-stage own seconds."""
        result = cleared.result
        for reply in replies.replies:
            if reply.rank == self.sampler_rank:
                result = reply.result
        if not self._timed:  # spp = 1: rank 0's own seconds are the batch's (with async
            # scheduling a batch waits behind the previous one after its submit)
            return StepDone(cleared.step_id, [] if result is None else result, (cleared.own_s,))
        stage_s = [0.0] * self.spec.spp
        stage_s[self._stage_of[0]] = cleared.own_s
        for reply in replies.replies:
            stage = self._stage_of[reply.rank]
            stage_s[stage] = max(stage_s[stage], reply.compute_s - reply.wait_s)
        return StepDone(cleared.step_id, [] if result is None else result, tuple(stage_s))

    def _fail(self, message: str) -> Any:
        self.failed = message
        raise WorkerError(message)

    def execute(self, plan: StepPlan) -> list[Sampled]:
        """Run one step alone and return its sampled rows in plan order."""
        if self._order:
            raise RuntimeError("execute: other batches are in flight")
        self.submit(plan)
        while not isinstance(event := self.next_event(), StepDone):
            pass
        return event.result

    def _keepalive(self) -> None:
        period = self.config.keepalive_s
        while not self._stop.wait(min(period, 0.5)):
            self.check_workers()
            if self.failed is not None:
                return
            if time.monotonic() - self._last < period:
                continue
            try:
                if not self._stop.is_set() and self.failed is None:
                    self._post(Ping())
            except Exception as exc:
                self.failed = f"a worker rank is gone: {type(exc).__name__}: {exc}"
                return

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
            try:
                self._post(Shutdown())
                self._drain_posts(self.join_timeout_s)
            except Exception as exc:
                self.failed = f"shutdown: {type(exc).__name__}: {exc}"
        self._close()

    def _close(self) -> None:
        self.closed = True
        self._jobs.put(None)
        self._expect.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=0.0 if self.failed is not None else 2.0)
        join_or_kill(self.processes, self.join_timeout_s if self.failed is None else 0.0)
        leave_world()
        restore_env(self._env)
