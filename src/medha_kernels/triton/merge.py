"""Launchers for the merge kernels (arguments already validated)."""

from __future__ import annotations

import torch
import triton

from medha_kernels.triton._common import block_d, head_block, rne_bf16
from medha_kernels.triton.kernels.merge import merge_state_kernel, merge_states_kernel

# States an N-way merge program reads at once (its tiles are [BLOCK_S, heads, dim],
# about 4K elements: with many states, one head per program).
MERGE_STATES_BLOCK = 32


def _merge2(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    v_out: torch.Tensor,
    s_out: torch.Tensor,
    mask: torch.Tensor | None,
) -> None:
    num_tokens, num_heads, head_dim = v_a.shape
    if num_tokens == 0 or num_heads == 0:
        return
    bd = block_d(head_dim)
    bh = head_block(num_heads, bd)
    grid = (num_tokens, triton.cdiv(num_heads, bh))
    merge_state_kernel[grid](
        v_a,
        s_a,
        v_b,
        s_b,
        v_out,
        s_out,
        s_a if mask is None else mask,
        num_heads,
        head_dim,
        *v_a.stride(),
        *s_a.stride(),
        *v_b.stride(),
        *s_b.stride(),
        *v_out.stride(),
        *s_out.stride(),
        HAS_MASK=mask is not None,
        RNE_BF16=rne_bf16(v_out.dtype),
        BLOCK_H=bh,
        BLOCK_D=bd,
    )


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.merge_state`."""
    v = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    s = torch.empty(s_a.shape, dtype=torch.float32, device=v_a.device)
    _merge2(v_a, s_a, v_b, s_b, v, s, None)
    return v, s


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """See :func:`medha_kernels.merge_state_in_place`; masked-off rows are not written."""
    _merge2(v, s, v_other, s_other, v, s, None if mask is None else mask.contiguous())


def launch_merge_states(
    v: torch.Tensor,
    s: torch.Tensor,
    v_out: torch.Tensor,
    s_out: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """Merge ``v [R, N, H, D]`` / ``s [R, N, H]`` into ``v_out`` / ``s_out``.

    With ``cu_seqlens`` row ``r`` is a sequence's split-KV partials, written to
    output row ``cu_seqlens[r]`` only if that sequence has one query.
    """
    rows, num, num_heads, head_dim = v.shape
    if rows == 0 or num_heads == 0:
        return
    bd = block_d(head_dim)
    bs = min(triton.next_power_of_2(max(num, 1)), MERGE_STATES_BLOCK)
    bh = head_block(num_heads, bd * bs)
    grid = (rows, triton.cdiv(num_heads, bh))
    merge_states_kernel[grid](
        v,
        s,
        v_out,
        s_out,
        s if cu_seqlens is None else cu_seqlens,
        num,
        num_heads,
        head_dim,
        *v.stride(),
        *s.stride(),
        *v_out.stride(),
        *s_out.stride(),
        DECODE_ROWS=cu_seqlens is not None,
        RNE_BF16=rne_bf16(v_out.dtype),
        BLOCK_S=bs,
        BLOCK_H=bh,
        BLOCK_D=bd,
    )


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.merge_states`: ``N == 0`` gives ``(0, -inf)``; ``N == 1`` copies."""
    num_tokens, _, num_heads, head_dim = v.shape
    v_out = torch.empty((num_tokens, num_heads, head_dim), dtype=v.dtype, device=v.device)
    s_out = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=v.device)
    launch_merge_states(v, s, v_out, s_out)
    return v_out, s_out
