"""glibc malloc settings for inference on the CPU: keep freed memory for the next step.

By default glibc serves large allocations with ``mmap`` and gives freed memory
at the top of the heap back to the kernel. A model step on the CPU allocates
and frees many megabytes of activations and attention tiles, so every step
then pays page faults to get the memory back; on a VM those cost tens of
percent of a step, and vary with the host. On the 2-core VM,
``medha-runtime profile tiny`` spent 14.3 s of 33 s in the kernel without
these settings and 1.3 s of 24 s with them; a 1,024-token chunk at 24K context
took 1.77 s against 1.03 s, and a 2-request decode after it 52 ms against 6 ms.

:func:`keep_freed_memory` raises the ``mmap`` threshold to glibc's maximum
(32 MiB), turns off trimming below 1 GiB of free heap, and pads each heap
growth by 64 MiB, as ``MALLOC_MMAP_THRESHOLD_`` and friends would (and over
any of those the user set). The price: the process keeps its peak heap
instead of returning it. Set ``MEDHA_CPU_MALLOC=default`` to leave glibc's
settings alone; it is read on CPU ranks only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger("medha_runtime")

ENV = "MEDHA_CPU_MALLOC"
# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when glibc took all of them.

    A no-op (False) off Linux, on a libc other than glibc, or with
    ``MEDHA_CPU_MALLOC=default``.
    """
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> bool:
    choice = os.environ.get(ENV) or "keep"
    if choice not in ("keep", "default"):
        raise ValueError(f"{ENV} must be 'keep' or 'default', got {choice!r}")
    if choice == "default" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    taken = [mallopt(param, value) == 1 for param, value in SETTINGS]  # try every one
    ok = all(taken)
    if not ok:
        logger.warning("glibc refused a malloc setting; CPU steps may pay page faults")
    return ok
