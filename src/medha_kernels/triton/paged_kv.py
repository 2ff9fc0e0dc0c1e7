"""Launcher for the paged-KV append kernel (arguments already validated)."""

from __future__ import annotations

import torch
import triton

from medha_kernels.triton._common import block_d, head_block, interpreting
from medha_kernels.triton.kernels.paged_kv import append_paged_kv_kernel


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """See :func:`medha_kernels.append_paged_kv`: rows go to ``slots[i]``; negative skips."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0 or num_heads == 0 or head_dim == 0:
        return
    bd = block_d(head_dim)
    bh = head_block(num_heads, bd)
    grid = (num_tokens, triton.cdiv(num_heads, bh))
    append_paged_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slots.contiguous(),
        k_cache.shape[1],
        num_heads,
        head_dim,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        RNE_BF16=interpreting() and k_cache.dtype == torch.bfloat16 and k.dtype != torch.bfloat16,
        BLOCK_H=bh,
        BLOCK_D=bd,
    )
