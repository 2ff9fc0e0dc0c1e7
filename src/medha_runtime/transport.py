"""How a worker talks to its driver: one small protocol, two implementations.

A :class:`WorkerTransport` carries :mod:`medha_runtime.messages` between a
worker and the driver: :meth:`~WorkerTransport.recv` blocks for the next
driver message, :meth:`~WorkerTransport.send` posts a reply. Both raise
:class:`TransportClosed` when the driver (or the link) is gone.

- :class:`PipeTransport`: the worker end of a ``multiprocessing`` pipe (one
  per worker; :class:`~medha_runtime.executor.MultiprocExecutor`). Every
  reply goes back, so the driver hears from every rank.
- :class:`DistTransport`: a ``torch.distributed`` gloo control group
  (:class:`~medha_runtime.dist_executor.DistributedExecutor`, several nodes
  or torchrun). The driver is rank 0 and posts each message to every rank
  point to point (:func:`post_object`: it does not wait for a rank still
  busy with an earlier step, which a broadcast would); the sampling rank's
  replies travel back and, with SPP > 1, every rank's
  :class:`~medha_runtime.messages.Done` (its stage times; posted without
  waiting, so a stage-0 rank goes on with the next step). Other replies stay
  local, and a failure on a rank other than the sampling one reaches the
  driver as a failed step on a peer (its traceback is on its own stderr).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Protocol

from medha_runtime.messages import Done, Failed, FromWorker, ToWorker


class TransportClosed(ConnectionError):
    """The driver or the link to it is gone."""


class WorkerTransport(Protocol):
    def recv(self) -> ToWorker:
        """The next message from the driver (blocking)."""
        ...

    def send(self, msg: FromWorker) -> None:
        """Reply to the driver."""
        ...


_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


def read_message(conn: Connection) -> bytes:
    """The next message on ``conn``, in ``Connection.send_bytes``' framing (a 4-byte
    big-endian length; -1 and 8 more bytes past 2 GiB), read with ``os.read`` on its
    descriptor: the bytes ``Connection.recv_bytes`` returns, without its buffer
    objects and per-call checks (a decode step reads one reply and one plan this
    way, each after a wake-up, with cold caches). Raises EOFError at the end of
    the pipe, OSError once ``conn`` is closed."""
    fd = conn.fileno()
    (size,) = _LENGTH.unpack(_read(fd, 4))
    if size == -1:
        (size,) = _LONG_LENGTH.unpack(_read(fd, 8))
    return _read(fd, size)


def _read(fd: int, n: int) -> bytes:
    data = os.read(fd, n)
    if len(data) == n:
        return data
    chunks = []
    while True:
        if not data:
            raise EOFError
        chunks.append(data)
        n -= len(data)
        if not n:
            return b"".join(chunks)
        data = os.read(fd, n)


def write_message(conn: Connection, data: bytes) -> None:
    """Write ``data`` as one message :func:`read_message` and ``Connection.recv_bytes``
    read (``Connection.send_bytes``' framing), with ``os.write`` on ``conn``'s descriptor."""
    fd = conn.fileno()
    n = len(data)
    head = _LENGTH.pack(n) if n <= 0x7FFFFFFF else _LENGTH.pack(-1) + _LONG_LENGTH.pack(n)
    view = memoryview(head + data)
    while view:
        view = view[os.write(fd, view) :]


class PipeTransport:
    """The worker end of a duplex ``multiprocessing`` pipe (pickled messages)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def recv(self) -> ToWorker:
        """The next message (:func:`read_message`, unpickled as ``Connection.recv`` does)."""
        try:
            return pickle.loads(read_message(self.conn))
        except (EOFError, OSError) as exc:
            raise TransportClosed(f"the driver's pipe closed ({exc!r})") from None

    def send(self, msg: FromWorker) -> None:
        """Post ``msg`` (plain data): pickled with :func:`pickle.dumps` and written as one
        message (:func:`write_message`), which the driver unpickles as it would
        ``Connection.send``'s. ``send`` pickles through ``ForkingPickler`` (a pickler
        with multiprocessing's reducers for file descriptors and shared tensors, which
        no worker message holds), about twice the time for a decode's :class:`Done`,
        and every decode step's reply waits for it."""
        try:
            write_message(self.conn, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise TransportClosed(f"the driver's pipe closed ({exc!r})") from None

    def pending(self) -> bool:
        """Whether a message (or the pipe's end) waits: :meth:`recv` would not block."""
        try:
            return self.conn.poll(0)
        except (EOFError, OSError):
            return True  # recv reports the closed pipe


class DistTransport:
    """A non-driver rank's end of the control group (see the module docstring).

    Args:
        control: the gloo control group (the driver is its rank 0).
        rank: this rank.
        replies: whether this rank's replies go to the driver (the sampling
            rank, unless it is the driver itself).
        times: whether this rank's :class:`Done` goes to the driver even if
            ``replies`` is False (SPP > 1: the driver sums the stage times);
            posted without waiting for the driver to take it.
    """

    def __init__(self, control: Any, *, rank: int, replies: bool, times: bool = False) -> None:
        self.control, self.rank, self.replies, self.times = control, rank, replies, times
        self._posted: deque[Posted] = deque()  # the times posted, not yet delivered

    def recv(self) -> ToWorker:
        try:
            return recv_object(0, self.control)
        except Exception as exc:
            raise TransportClosed(f"the driver is gone ({type(exc).__name__}: {exc})") from None

    def send(self, msg: FromWorker) -> None:
        if isinstance(msg, Failed):
            text = f"medha-runtime worker rank {self.rank}: {msg.error}"
            print(text, file=sys.stderr, flush=True)
        if self.replies and isinstance(msg, (Done, Failed)):
            wait = True
        elif self.times and isinstance(msg, Done):
            wait = False  # the times only: the driver takes them when it can
        else:
            return
        try:
            if wait:
                for work in post_object(msg, 0, self.control).works:
                    work.wait()
            else:
                reap(self._posted)
                self._posted.append(post_object(msg, 0, self.control))
        except Exception as exc:
            raise TransportClosed(f"the driver is gone ({type(exc).__name__}: {exc})") from None


class Posted:
    """The sends of one :func:`post_object`; their buffers live as long as this does.

    Attributes:
        works: the ``torch.distributed`` works (size, then payload).
        buffers: the int64 ``[1]`` size and the uint8 ``[size]`` pickled payload.
    """

    def __init__(self, works: list[Any], buffers: list[Any]) -> None:
        self.works, self.buffers = works, buffers

    def done(self) -> bool:
        """Whether every send completed (raises the send's error if one failed)."""
        if all(w.is_completed() for w in self.works):
            for w in self.works:
                w.wait()  # raises if the send failed
            return True
        return False


def reap(posted: deque[Posted]) -> None:
    """Drop the delivered posts from the front of ``posted`` (oldest first; raises a
    failed send's error)."""
    while posted and posted[0].done():
        posted.popleft()


def post_object(obj: Any, dst: int, group: Any) -> Posted:
    """Send ``obj`` (pickled) to global rank ``dst`` on ``group`` without waiting.

    Two non-blocking sends in order: an int64 ``[1]`` size, then the uint8
    payload. Messages to one rank arrive in the order they were posted.
    """
    import torch
    import torch.distributed as dist

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.int64)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    works = [dist.isend(size, dst, group=group), dist.isend(payload, dst, group=group)]
    return Posted(works, [size, payload])


def recv_object(src: int, group: Any) -> Any:
    """The next object :func:`post_object` sent from global rank ``src`` (blocking)."""
    import torch
    import torch.distributed as dist

    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())
