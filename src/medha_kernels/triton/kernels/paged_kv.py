"""Scatter new K/V rows into a paged cache."""

from __future__ import annotations

import triton
import triton.language as tl

from medha_kernels.triton.kernels.common import round_bf16


@triton.jit
def append_paged_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    block_size,
    H,
    D,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_kc_blk,
    stride_kc_tok,
    stride_kc_h,
    stride_kc_d,
    stride_vc_blk,
    stride_vc_tok,
    stride_vc_h,
    stride_vc_d,
    RNE_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(H, BLOCK_H))``: token ``t`` -> slot ``slots[t]`` (< 0: skip)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    num_h = tl.where(slot >= 0, H, 0)  # a negative slot writes nothing
    ok = (offs_h[:, None] < num_h) & (offs_d[None, :] < D)
    blk = slot // block_size
    pos = slot % block_size
    k = tl.load(
        k_ptr + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :] * stride_k_d,
        mask=ok,
    )
    v = tl.load(
        v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :] * stride_v_d,
        mask=ok,
    )
    if RNE_BF16:  # interpreter: converting to bf16 must round like torch does
        k = round_bf16(k)
        v = round_bf16(v)
    kc = k_cache_ptr + blk * stride_kc_blk + pos * stride_kc_tok
    vc = v_cache_ptr + blk * stride_vc_blk + pos * stride_vc_tok
    tl.store(
        kc + offs_h[:, None] * stride_kc_h + offs_d[None, :] * stride_kc_d,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=ok,
    )
    tl.store(
        vc + offs_h[:, None] * stride_vc_h + offs_d[None, :] * stride_vc_d,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=ok,
    )
