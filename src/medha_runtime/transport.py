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
  or torchrun). The driver is rank 0 and broadcasts each message; only the
  sampling rank's replies travel back (point to point); the other ranks'
  replies stay local, and their failures reach the driver as a failed
  collective (their traceback is on their own stderr).
"""

from __future__ import annotations

import sys
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


class PipeTransport:
    """The worker end of a duplex ``multiprocessing`` pipe (pickled messages)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def recv(self) -> ToWorker:
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise TransportClosed(f"the driver's pipe closed ({exc!r})") from None

    def send(self, msg: FromWorker) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise TransportClosed(f"the driver's pipe closed ({exc!r})") from None


class DistTransport:
    """A non-driver rank's end of the control group (see the module docstring).

    Args:
        control: the gloo control group (the driver is its rank 0).
        rank: this rank.
        replies: whether this rank's replies go to the driver (the sampling
            rank, unless it is the driver itself).
    """

    def __init__(self, control: Any, *, rank: int, replies: bool) -> None:
        self.control, self.rank, self.replies = control, rank, replies

    def recv(self) -> ToWorker:
        import torch.distributed as dist

        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except Exception as exc:
            raise TransportClosed(f"the driver is gone ({type(exc).__name__}: {exc})") from None
        return box[0]

    def send(self, msg: FromWorker) -> None:
        import torch.distributed as dist

        if isinstance(msg, Failed):
            text = f"medha-runtime worker rank {self.rank}: {msg.error}"
            print(text, file=sys.stderr, flush=True)
        if not self.replies or not isinstance(msg, (Done, Failed)):
            return
        try:
            dist.send_object_list([msg], dst=0, group=self.control)
        except Exception as exc:
            raise TransportClosed(f"the driver is gone ({type(exc).__name__}: {exc})") from None
