"""Small ``@triton.jit`` helpers shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """Round fp32 ``x`` to the nearest bf16 value (ties to even), still as fp32.

    The Triton interpreter truncates fp32 -> bf16; after this the truncation is
    exact, so interpreted stores match torch (and a GPU) bit for bit. NaN passes.
    """
    x = x.to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def clean_lse(s):
    """Natural-log LSE with +inf and NaN mapped to -inf (an empty state)."""
    return tl.where(s < float("inf"), s, float("-inf"))
