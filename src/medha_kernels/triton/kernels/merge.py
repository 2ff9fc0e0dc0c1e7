"""Merging attention states ``(v, s)``: two-way (optionally in place, masked) and N-way.

One program handles one token and ``BLOCK_H`` heads x ``BLOCK_D`` (padded) dims;
the N-way merge reads ``BLOCK_S`` of the token's states at a time.
Weights are ``exp2((s - max s) * log2 e)``, never ``exp(s)``, so a common offset
is exact. +inf/NaN LSEs count as empty; an empty state's ``v`` is never loaded
(selected away), so garbage in it cannot leak. All-empty gives ``(0, -inf)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from medha_kernels.triton.kernels.common import clean_lse, round_bf16


@triton.jit
def merge_state_kernel(
    va_ptr,
    sa_ptr,
    vb_ptr,
    sb_ptr,
    vo_ptr,
    so_ptr,
    mask_ptr,
    H,
    D,
    stride_va_t,
    stride_va_h,
    stride_va_d,
    stride_sa_t,
    stride_sa_h,
    stride_vb_t,
    stride_vb_h,
    stride_vb_d,
    stride_sb_t,
    stride_sb_h,
    stride_vo_t,
    stride_vo_h,
    stride_vo_d,
    stride_so_t,
    stride_so_h,
    HAS_MASK: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(num_tokens, cdiv(H, BLOCK_H))``. Output may alias ``a`` (in place)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    num_h = H
    if HAS_MASK:  # rows with a False mask are neither read nor written
        num_h = tl.where(tl.load(mask_ptr + t) != 0, H, 0)
    write = offs_h < num_h
    write_hd = write[:, None] & (offs_d[None, :] < D)

    s_a = clean_lse(tl.load(sa_ptr + t * stride_sa_t + offs_h * stride_sa_h, mask=write, other=0))
    s_b = clean_lse(tl.load(sb_ptr + t * stride_sb_t + offs_h * stride_sb_h, mask=write, other=0))
    m = tl.maximum(s_a, s_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp2((s_a - m_safe) * 1.4426950408889634)
    w_b = tl.exp2((s_b - m_safe) * 1.4426950408889634)
    v_a = tl.load(
        va_ptr + t * stride_va_t + offs_h[:, None] * stride_va_h + offs_d[None, :] * stride_va_d,
        mask=write_hd & (w_a > 0)[:, None],
        other=0.0,
    ).to(tl.float32)
    v_b = tl.load(
        vb_ptr + t * stride_vb_t + offs_h[:, None] * stride_vb_h + offs_d[None, :] * stride_vb_d,
        mask=write_hd & (w_b > 0)[:, None],
        other=0.0,
    ).to(tl.float32)
    total = w_a + w_b
    nonempty = total > 0
    total_safe = tl.where(nonempty, total, 1.0)
    out = (w_a[:, None] * v_a + w_b[:, None] * v_b) / total_safe[:, None]
    lse = tl.where(nonempty, m_safe + tl.log2(total_safe) * 0.6931471805599453, float("-inf"))
    if RNE_BF16:
        out = round_bf16(out)
    tl.store(
        vo_ptr + t * stride_vo_t + offs_h[:, None] * stride_vo_h + offs_d[None, :] * stride_vo_d,
        out.to(vo_ptr.dtype.element_ty),
        mask=write_hd,
    )
    tl.store(so_ptr + t * stride_so_t + offs_h * stride_so_h, lse, mask=write)


@triton.jit
def merge_states_kernel(
    v_ptr,
    s_ptr,
    vo_ptr,
    so_ptr,
    cu_seqlens_ptr,
    N,
    H,
    D,
    stride_v_t,
    stride_v_n,
    stride_v_h,
    stride_v_d,
    stride_s_t,
    stride_s_n,
    stride_s_h,
    stride_vo_t,
    stride_vo_h,
    stride_vo_d,
    stride_so_t,
    stride_so_h,
    DECODE_ROWS: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(num_rows, cdiv(H, BLOCK_H))``: merge ``N`` states of input row ``t``.

    The states are read ``BLOCK_S`` at a time (tiles ``[BLOCK_S, BLOCK_H,
    BLOCK_D]``) and folded into a running maximum, so a program makes
    ``cdiv(N, BLOCK_S)`` dependent loads, not ``N`` (a decode's 132 split-KV
    partials were 264 loads in sequence).

    With ``DECODE_ROWS`` input row ``t`` is sequence ``t`` of a paged batch (its
    split-KV partials); it is written to output row ``cu_seqlens[t]`` and only if
    that sequence has exactly one query.
    """
    t = tl.program_id(0)
    out_row = t.to(tl.int64)
    num = N
    num_h = H
    if DECODE_ROWS:  # a sequence without exactly one query: nothing to read or write
        q_lo = tl.load(cu_seqlens_ptr + t)
        q_hi = tl.load(cu_seqlens_ptr + t + 1)
        out_row = q_lo.to(tl.int64)
        num = tl.where(q_hi - q_lo == 1, N, 0)
        num_h = tl.where(q_hi - q_lo == 1, H, 0)
    t = t.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_h
    hd_ok = h_ok[:, None] & (offs_d[None, :] < D)
    s_rows = s_ptr + t * stride_s_t + offs_h[None, :] * stride_s_h
    v_rows = (
        v_ptr
        + t * stride_v_t
        + offs_h[None, :, None] * stride_v_h
        + offs_d[None, None, :] * stride_v_d
    )

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(0, num, BLOCK_S):
        n = n0 + offs_s
        ok = (n[:, None] < num) & h_ok[None, :]
        s_n = clean_lse(tl.load(s_rows + n[:, None] * stride_s_n, mask=ok, other=float("-inf")))
        m_new = tl.maximum(m, tl.max(s_n, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m - m_safe) * 1.4426950408889634)
        w = tl.exp2((s_n - m_safe[None, :]) * 1.4426950408889634)
        v_n = tl.load(
            v_rows + n[:, None, None] * stride_v_n,
            mask=hd_ok[None, :, :] & (w > 0)[:, :, None],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v_n.to(tl.float32), axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    nonempty = total > 0
    total_safe = tl.where(nonempty, total, 1.0)
    out = acc / total_safe[:, None]
    lse = tl.where(nonempty, m_safe + tl.log2(total_safe) * 0.6931471805599453, float("-inf"))
    if RNE_BF16:
        out = round_bf16(out)
    tl.store(
        vo_ptr
        + out_row * stride_vo_t
        + offs_h[:, None] * stride_vo_h
        + offs_d[None, :] * stride_vo_d,
        out.to(vo_ptr.dtype.element_ty),
        mask=hd_ok,
    )
    tl.store(so_ptr + out_row * stride_so_t + offs_h * stride_so_h, lse, mask=h_ok)
