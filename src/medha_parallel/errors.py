"""Communication failures, named by group and operation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class CommunicationError(RuntimeError):
    """A collective or point-to-point operation failed or timed out.

    After one, the process group is unusable: tear it down, do not retry.
    """


@contextlib.contextmanager
def named_comm(group: str, op: str) -> Iterator[None]:
    """Re-raise any failure inside as a CommunicationError naming ``group`` and ``op``."""
    try:
        yield
    except CommunicationError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses
        raise CommunicationError(f"{op} on the {group} group failed: {exc}") from exc
