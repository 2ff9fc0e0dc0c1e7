"""Communication failures, named by group and operation."""

from __future__ import annotations


class CommunicationError(RuntimeError):
    """A collective or point-to-point operation failed or timed out.

    After one, the process group is unusable: tear it down, do not retry.
    """


class named_comm:
    """Re-raise any failure inside as a CommunicationError naming ``group`` and ``op``.

    A class rather than a ``contextlib.contextmanager`` generator: it wraps every
    collective and hand-off (per layer, per micro-batch), and a generator costs
    several times more to enter and leave.
    """

    __slots__ = ("group", "op")

    def __init__(self, group: str, op: str) -> None:
        self.group, self.op = group, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: object, exc: BaseException | None, tb: object) -> bool:
        if exc is None or isinstance(exc, CommunicationError) or not isinstance(exc, Exception):
            return False  # nothing, already named, or not ours to name (KeyboardInterrupt)
        # gloo/NCCL raise RuntimeError subclasses
        raise CommunicationError(f"{self.op} on the {self.group} group failed: {exc}") from exc
