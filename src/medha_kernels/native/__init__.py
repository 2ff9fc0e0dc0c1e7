"""The ``native`` backend: merge kernels in C++ (CPU) and CUDA, CPU attention, built on first use.

The sources in ``csrc/`` are compiled by :func:`medha_kernels.native.jit.get_module`
the first time an op runs on a device type, then reused from the on-disk cache
(see :mod:`medha_kernels.native.jit`). Importing this package and
:func:`supports_device` compile nothing.

The kernels read contiguous tensors: these wrappers call ``.contiguous()`` on
the inputs (a copy only when needed). For ``merge_state_in_place`` on a
non-contiguous ``v`` or ``s``, the merge runs on contiguous copies and only the
selected rows are copied back, so rows with ``mask`` False are never written.
``v_other``/``s_other`` must not overlap ``v``/``s``.

Attention (:mod:`medha_kernels.native.attention`) runs on the CPU only:
:func:`can_run` declines it for other devices.

Semantics are those of the ``torch`` backend: natural-log LSE, an LSE of -inf,
+inf or NaN marks an empty state whose ``v`` is ignored, all-empty rows give
``(0, -inf)``, accumulation is in fp32 and ``v`` keeps its dtype.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from medha_kernels.native.attention import chunked_prefill_attention as chunked_prefill_attention
from medha_kernels.native.attention import paged_attention as paged_attention
from medha_kernels.native.attention import plan_paged_attention as plan_paged_attention
from medha_kernels.native.jit import SOURCES, cxx_available, get_module, ninja_available

__all__ = [
    "can_run",
    "chunked_prefill_attention",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "paged_attention",
    "plan_paged_attention",
    "supports_device",
]

_CPU_ONLY = ("chunked_prefill_attention", "paged_attention")

_CSRC = Path(__file__).resolve().parent / "csrc"


@functools.cache
def _toolchain(device_type: str, cxx: str | None, path: str | None) -> bool:
    del cxx, path  # cache keys: re-check when the compiler or PATH changes
    if device_type not in SOURCES or not all((_CSRC / f).is_file() for f in SOURCES[device_type]):
        return False
    if not (cxx_available() and ninja_available()):
        return False
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return False
        from torch.utils.cpp_extension import CUDA_HOME

        return CUDA_HOME is not None
    return True


def supports_device(device: torch.device) -> bool:
    """Whether the kernels can be built and run for ``device``; builds nothing.

    CPU needs a C++ compiler (``$CXX`` or ``c++``) and ninja; CUDA also needs a
    GPU and a CUDA toolkit (``torch.utils.cpp_extension.CUDA_HOME``).
    """
    return _toolchain(torch.device(device).type, os.environ.get("CXX"), os.environ.get("PATH"))


def cpu_module(opt_out: str):
    """The CPU extension for an op family, or None where it cannot run here or the
    environment variable ``opt_out`` is ``0`` (builds on first use; its callers
    cache the answer, so the environment is read once per process)."""
    if os.environ.get(opt_out, "1") == "0" or not supports_device(torch.device("cpu")):
        return None
    return get_module("cpu")


def can_run(op: str, *args: object) -> bool:
    """Attention only on CPU tensors (its first argument is ``q``); merges anywhere."""
    if op not in _CPU_ONLY:
        return True
    q = args[0] if args else None
    return isinstance(q, torch.Tensor) and q.device.type == "cpu"


def _ext(t: torch.Tensor):
    return get_module(t.device.type)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states ``[T, H, D]`` / ``[T, H]`` (validated by the caller)."""
    v, s = _ext(v_a).merge_state(
        v_a.contiguous(), s_a.contiguous(), v_b.contiguous(), s_b.contiguous()
    )
    return v, s


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)``; rows where ``mask`` is False are untouched."""
    ext = _ext(v)
    other = (v_other.contiguous(), s_other.contiguous())
    mask = None if mask is None else mask.contiguous()
    if v.is_contiguous() and s.is_contiguous():
        ext.merge_state_in_place(v, s, *other, mask)
        return
    v_c, s_c = v.contiguous(), s.contiguous()
    ext.merge_state_in_place(v_c, s_c, *other, mask)
    if mask is None:
        v.copy_(v_c)
        s.copy_(s_c)
        return
    rows = mask.nonzero(as_tuple=True)[0]
    v.index_copy_(0, rows, v_c.index_select(0, rows))
    s.index_copy_(0, rows, s_c.index_select(0, rows))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N`` states ``[T, N, H, D]`` / ``[T, N, H]`` into ``[T, H, D]`` / ``[T, H]``."""
    v_out, s_out = _ext(v).merge_states(v.contiguous(), s.contiguous())
    return v_out, s_out
