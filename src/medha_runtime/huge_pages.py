"""CPU tensors on transparent huge pages: a model's weights and its KV cache.

A CPU decode step streams every weight once and, at long context, each
layer's KV blocks in the block table's order. On 4 KB pages that walks
hundreds of thousands of pages a step (SmolLM2-135M's 538 MB of fp32 weights:
~131K pages), far more than the TLB holds. Linux backs anonymous memory with
2 MB pages where ``/sys/kernel/mm/transparent_hugepage/enabled`` says
``always``, or ``madvise`` and the range was ``madvise(MADV_HUGEPAGE)``d;
allocations from the malloc heap (where :mod:`medha_runtime.cpu_memory`
sends everything under 32 MiB) never are under ``madvise``.

:class:`HugePageArena` is one anonymous mapping, 2 MB aligned and madvised,
that tensors are carved out of (64-byte aligned, packed one after another);
each tensor keeps the mapping alive. :func:`new_arena` returns one, or None
where huge pages cannot be had (not Linux, THP ``never`` or absent, ``madvise``
refused) or ``MEDHA_CPU_HUGE_PAGES=off``: callers then allocate as before.
The kernel may still fall back to 4 KB pages for parts of an arena (no free 2
MB page at fault time); :func:`huge_page_bytes` reads how much is huge.

Used at load for all of a CPU model's weights (one arena per rank,
:func:`medha_runtime.model.loader.load_weights`) and for the CPU KV cache
(one arena for every layer's K and V). ``MEDHA_CPU_HUGE_PAGES=off`` turns
both off (default ``on``); the same code runs either way, so A/B runs differ
only in the pages. Each process that loads weights reads it: the worker
processes of a multi-rank engine inherit the environment of the forkserver,
which starts with the first such engine, so set it before that (changing it
later in the same driver process does not reach them).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from collections.abc import Sequence

import torch

ENV = "MEDHA_CPU_HUGE_PAGES"
HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start: a cache line (and any dtype's element size)
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MADV_HUGEPAGE = 14  # asm-generic/mman-common.h

_madvise = None  # libc's madvise, resolved once


def enabled() -> bool:
    """True unless ``MEDHA_CPU_HUGE_PAGES=off``; raises ValueError on other values than on/off."""
    choice = os.environ.get(ENV) or "on"
    if choice not in ("on", "off"):
        raise ValueError(f"{ENV} must be 'on' or 'off', got {choice!r}")
    return choice == "on"


def thp_mode(path: str | None = None) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``); None where it has none.

    Read from ``path`` (default :data:`THP_ENABLED`).
    """
    try:
        with open(path or THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, stop = text.find("["), text.find("]")
    return text[start + 1 : stop] if 0 <= start < stop else None


def packed_bytes(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """Bytes an arena needs for tensors of these ``(shape, dtype)``, each 64-byte aligned."""
    total = 0
    for shape, dtype in specs:
        total += _round_up(_nbytes(shape, dtype), ALIGN)
    return total


class HugePageArena:
    """One anonymous mapping of at least ``nbytes``, 2 MB aligned and ``MADV_HUGEPAGE``.

    Build it with :func:`new_arena` (which returns None where huge pages are
    unavailable). Pages are faulted in, as huge pages where the kernel has
    them, when a tensor carved out of it is first written.

    Args:
        nbytes: the bytes the tensors will take (:func:`packed_bytes`).

    Raises:
        OSError: ``madvise`` refused the range (e.g. a kernel without THP).
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.capacity = _round_up(max(nbytes, 1), HUGE_PAGE)
        # one spare huge page: the mapping's start is only page aligned
        self._map = mmap.mmap(
            -1, self.capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        # uint8 view of the whole mapping; every tensor is a view of it, so the
        # mapping lives as long as any of them
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._start = (-self._bytes.data_ptr()) % HUGE_PAGE
        _madvise_hugepage(self._bytes.data_ptr() + self._start, self.capacity)
        self._used = 0

    @property
    def address(self) -> int:
        """The first tensor's address (2 MB aligned)."""
        return self._bytes.data_ptr() + self._start

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` from the arena.

        Raises:
            ValueError: the arena has no room left for it.
        """
        nbytes = _nbytes(shape, dtype)
        if self._used + nbytes > self.capacity:
            raise ValueError(
                f"arena of {self.capacity} bytes has {self.capacity - self._used} left, "
                f"a {list(shape)} {dtype} tensor needs {nbytes}"
            )
        at = self._start + self._used
        self._used += _round_up(nbytes, ALIGN)
        return self._bytes[at : at + nbytes].view(dtype).view(tuple(shape))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor ``t`` (any shape and dtype) in the arena."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out


def new_arena(nbytes: int) -> HugePageArena | None:
    """A :class:`HugePageArena` of ``nbytes``, or None: switched off, or no THP to ask for."""
    if not enabled() or not sys.platform.startswith("linux"):
        return None
    if thp_mode() not in ("always", "madvise"):
        return None
    try:
        return HugePageArena(nbytes)
    except OSError:
        return None


def zeros(count: int, shape: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """``count`` zeroed tensors of ``shape`` and ``dtype`` in one arena; None as :func:`new_arena`.

    The zeros are written, so every page is faulted in (huge where the kernel
    has them) now rather than in a step.
    """
    arena = new_arena(packed_bytes([(shape, dtype)] * count))
    if arena is None:
        return None
    out = [arena.empty(shape, dtype) for _ in range(count)]
    for t in out:
        t.zero_()
    return out


def huge_page_bytes(t: torch.Tensor, smaps: str = "/proc/self/smaps") -> int:
    """``AnonHugePages`` of the mapping holding ``t``'s first byte (0 where none is found)."""
    address = t.data_ptr()
    try:
        with open(smaps) as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def _madvise_hugepage(address: int, length: int) -> None:
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    if _madvise(address, length, MADV_HUGEPAGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_HUGEPAGE) failed: {os.strerror(err)}")


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(int(s) for s in shape) * dtype.itemsize


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
