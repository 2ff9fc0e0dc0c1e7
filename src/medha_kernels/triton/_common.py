"""Launch-side helpers shared by the Triton launchers."""

from __future__ import annotations

import torch
import triton

from medha_kernels.backends import triton_interpreting


def interpreting() -> bool:
    return triton_interpreting()


def rne_bf16(dtype: torch.dtype) -> bool:
    """Whether stores into ``dtype`` need hand rounding (the interpreter truncates to bf16)."""
    return dtype == torch.bfloat16 and interpreting()


def block_d(head_dim: int) -> int:
    """Padded head dim: a power of two, at least 16 (``tl.dot``'s minimum on GPU)."""
    return max(16, triton.next_power_of_2(head_dim))


def head_block(num_heads: int, bd: int, elems: int = 4096) -> int:
    """Heads per program for per-token kernels: about ``elems`` elements per tile."""
    return max(1, min(triton.next_power_of_2(max(num_heads, 1)), elems // bd))
