"""The HTTP process's side of the engine: start it, feed it, route its outputs.

:class:`EngineClient` starts the engine process (``spawn``), waits for
:class:`~medha_runtime.server.engine_proc.EngineReady`, then runs one asyncio
task that reads the engine's messages and puts each request's deltas on its
own queue, and one task that watches the process (liveness and heartbeats).
When the engine dies every pending request gets an error and
:attr:`EngineClient.dead` is set (``/health`` answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from medha_runtime.server.engine_proc import EngineArgs, engine_main
from medha_runtime.server.messages import (
    AbortRequest,
    AddAccepted,
    AddFailed,
    AddRequest,
    Alive,
    EngineFailed,
    EngineReady,
    EngineStopped,
    Heartbeat,
    RequestDelta,
    Shutdown,
)

#: the engine counts as dead when no heartbeat or pulse arrived for this long
#: (seconds; ``MEDHA_ENGINE_TIMEOUT_S`` overrides it)
HEARTBEAT_TIMEOUT_S = float(os.environ.get("MEDHA_ENGINE_TIMEOUT_S", "5"))


class EngineDeadError(RuntimeError):
    """The engine process is gone."""


class StartCancelled(EngineDeadError):
    """The server was told to stop while the engine was starting."""


@dataclass
class Accepted:
    """Put on a request's queue when the engine took it (where it asked to be told)."""

    index: int


@dataclass
class Failure:
    """Put on a request's queue when it cannot go on."""

    message: str
    bad_request: bool = False
    #: the request's index on its queue when the engine refused it (it never ran)
    index: int | None = None


class EngineClient:
    def __init__(self, args: EngineArgs, *, startup_timeout_s: float = 600.0) -> None:
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.ready: EngineReady | None = None
        self.dead: str | None = None
        self.stats: Heartbeat | None = None
        self.last_beat = 0.0
        self.queues: dict[str, tuple[asyncio.Queue[Any], int]] = {}
        self.on_heartbeat: list[Any] = []
        #: called once, with the reason, when the engine is found dead
        self.on_dead: list[Any] = []
        #: called once when the engine stopped on SIGTERM (EngineStopped)
        self.on_stopped: list[Any] = []
        #: the signal the engine stopped on, once it said so
        self.stopped: str | None = None
        self._dir = tempfile.mkdtemp(prefix="medha-serve-")
        self.in_addr = f"ipc://{os.path.join(self._dir, 'to_engine')}"
        self.out_addr = f"ipc://{os.path.join(self._dir, 'from_engine')}"
        self.proc: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._aborts: set[asyncio.Task[Any]] = set()
        self.started_at = time.time()
        #: set (by a signal) to give up waiting for the engine to start
        self.start_cancelled = False

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        if self.start_cancelled:  # a signal came before the engine was started
            raise StartCancelled("the server was stopped before the engine started")
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.out_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self.in_addr)
        spawn = mp.get_context("spawn")
        # not daemonic: the engine may start its own worker processes (tp/spp/kvp > 1)
        self.proc = spawn.Process(
            target=engine_main,
            args=(self.args, self.in_addr, self.out_addr, os.getpid()),
            name="medha-engine",
        )
        self.proc.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while self.ready is None:
            if self.start_cancelled:
                raise StartCancelled("the server was stopped while the engine was starting")
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError("the engine did not start in time")
            if await self._pull.poll(timeout=200):
                msg = pickle.loads(await self._pull.recv())
                if isinstance(msg, EngineReady):
                    self.ready = msg
                elif isinstance(msg, EngineFailed):
                    raise EngineDeadError(f"the engine failed to start: {msg.message}")
            elif not self.proc.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self.proc.exitcode}")
        self.last_beat = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._watch_loop()),
        ]

    async def stop(self, timeout_s: float = 2.0) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.proc is not None and self.proc.is_alive():
            with contextlib.suppress(Exception):
                await self._push.send(pickle.dumps(Shutdown()))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.proc.join, timeout_s)
            if self.proc.is_alive():
                self.proc.terminate()
                await loop.run_in_executor(None, self.proc.join, 1.0)
            if self.proc.is_alive():
                self.proc.kill()
                await loop.run_in_executor(None, self.proc.join, 1.0)
        self._fail_all("the server is shutting down")
        with contextlib.suppress(Exception):
            self._pull.close(linger=0)
            self._push.close(linger=0)
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _mark_dead(self, why: str) -> None:
        first = self.dead is None
        if first:
            self.dead = why
        self._fail_all(f"the engine died: {why}")
        if first:
            for cb in self.on_dead:
                cb(why)

    def _fail_all(self, message: str) -> None:
        for q, _ in list(self.queues.values()):
            q.put_nowait(Failure(message))
        self.queues.clear()

    async def _read_loop(self) -> None:
        while True:
            msg = pickle.loads(await self._pull.recv())
            if isinstance(msg, RequestDelta):
                entry = self.queues.get(msg.request_id)
                if entry is not None:
                    entry[0].put_nowait((entry[1], msg, time.monotonic()))
                    if msg.finish_reason is not None:
                        self.queues.pop(msg.request_id, None)
            elif isinstance(msg, AddAccepted):
                entry = self.queues.get(msg.request_id)
                if entry is not None:
                    entry[0].put_nowait(Accepted(entry[1]))
            elif isinstance(msg, AddFailed):
                entry = self.queues.pop(msg.request_id, None)
                if entry is not None:
                    entry[0].put_nowait(Failure(msg.message, msg.bad_request, entry[1]))
            elif isinstance(msg, Alive):
                self.last_beat = time.monotonic()
            elif isinstance(msg, Heartbeat):
                self.last_beat = time.monotonic()
                self.stats = msg
                for cb in self.on_heartbeat:
                    cb(msg)
                if msg.error is not None:
                    self._mark_dead(msg.error)
            elif isinstance(msg, EngineFailed):
                self._mark_dead(msg.message)
            elif isinstance(msg, EngineStopped) and self.stopped is None:
                self.stopped = msg.signal
                for cb in self.on_stopped:
                    cb(msg.signal)

    async def _watch_loop(self) -> None:
        while self.dead is None and self.stopped is None:
            await asyncio.sleep(0.25)
            if not self.proc.is_alive():
                if self.proc.exitcode == 0:  # a clean stop: its EngineStopped may be in flight
                    await asyncio.sleep(0.5)
                    if self.stopped is not None:
                        return
                self._mark_dead(f"the engine process exited with code {self.proc.exitcode}")
            elif time.monotonic() - self.last_beat > HEARTBEAT_TIMEOUT_S:
                self._mark_dead(f"no heartbeat from the engine for {HEARTBEAT_TIMEOUT_S:g} s")

    # ----------------------------------------------------------------- requests
    async def add(self, msg: AddRequest, queue: asyncio.Queue[Any], index: int) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.queues[msg.request_id] = (queue, index)
        await self._push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def abort_soon(self, request_id: str) -> None:
        """:meth:`abort` from synchronous code (a task this client keeps until it ran)."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def fail_all(self, message: str) -> list[str]:
        """End every pending request with ``message`` and abort it in the engine
        (shutdown); returns their ids."""
        ids = list(self.queues)
        self._fail_all(message)
        for rid in ids:
            self.abort_soon(rid)
        return ids

    async def abort(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        if self.dead is None and self.proc is not None:
            with contextlib.suppress(Exception):
                await self._push.send(pickle.dumps(AbortRequest(request_id)))
