"""Flash attention with a natural-log LSE, for contiguous and paged KV.

Every program owns a tile of ``BLOCK_M`` rows = ``BLOCK_Q`` query tokens x the
``GROUP`` query heads that share one KV head (row ``r``: token ``r // GROUP``,
head ``kv_head * GROUP + r % GROUP``), so each KV tile is loaded once for the
whole group. Scores are scaled by ``sm_scale * log2(e)`` and exponentiated with
``exp2``; the LSE is stored as ``(m + log2 l) * ln 2``. Rows that see no key
get ``(0, -inf)``. With ``UPCAST`` (on only in the interpreter, which gets
bf16 arithmetic wrong) tiles are cast to fp32 right after loading.
"""

from __future__ import annotations

import triton
import triton.language as tl

from medha_kernels.triton.kernels.common import round_bf16


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    row_ok,
    lo,
    hi,
    k_ptr,
    v_ptr,
    bt_ptr,
    stride_bt_n,
    block_size,
    stride_k_blk,
    stride_k_tok,
    stride_k_d,
    stride_v_blk,
    stride_v_tok,
    stride_v_d,
    D,
    qk_scale,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAGED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Fold keys ``[lo, hi)`` into the online-softmax state ``(acc, m_i, l_i)``.

    Without ``MASKED`` every key of every tile is in range and visible to every
    row (the caller guarantees it), so no key or causal mask is built.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        j_ok = j < hi
        if PAGED:
            if MASKED:
                blk = tl.load(bt_ptr + (j // block_size) * stride_bt_n, mask=j_ok, other=0)
            else:
                blk = tl.load(bt_ptr + (j // block_size) * stride_bt_n)
            blk = blk.to(tl.int64)
            slot = (j % block_size).to(tl.int64)
            k_off = blk * stride_k_blk + slot * stride_k_tok
            v_off = blk * stride_v_blk + slot * stride_v_tok
        else:
            k_off = j.to(tl.int64) * stride_k_tok
            v_off = j.to(tl.int64) * stride_v_tok
        k_ptrs = k_ptr + k_off[None, :] + offs_d[:, None] * stride_k_d  # [BLOCK_D, BLOCK_N]
        v_ptrs = v_ptr + v_off[:, None] + offs_d[None, :] * stride_v_d  # [BLOCK_N, BLOCK_D]
        if MASKED or not EVEN_D:
            k = tl.load(k_ptrs, mask=j_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
        if MASKED:
            ok = row_ok[:, None] & j_ok[None, :]
            if CAUSAL:
                ok = ok & (j[None, :] <= q_pos[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:  # every score is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend(
    q,
    q_pos,
    row_ok,
    kv_lo,
    kv_hi,
    vis_hi,
    k_ptr,
    v_ptr,
    bt_ptr,
    stride_bt_n,
    block_size,
    stride_k_blk,
    stride_k_tok,
    stride_k_d,
    stride_v_blk,
    stride_v_tok,
    stride_v_d,
    D,
    qk_scale,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAGED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Online softmax of the ``q`` tile over keys ``[kv_lo, kv_hi)`` -> ``(acc, m, l)``.

    ``k_ptr``/``v_ptr`` already point at the KV head. Contiguous KV: key ``j`` is
    at ``j * stride_*_tok``. Paged KV: at ``block_table[j // block_size] *
    stride_*_blk + (j % block_size) * stride_*_tok``. ``m`` is in log2 units.
    Keys below ``vis_hi`` are visible to every row of the tile: whole ``BLOCK_N``
    tiles of them run without masks, the rest (the diagonal and the ragged end)
    with them.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full = tl.maximum(tl.minimum(kv_hi, vis_hi) - kv_lo, 0)
    full_hi = kv_lo + (full // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, row_ok, kv_lo, full_hi, k_ptr, v_ptr, bt_ptr, stride_bt_n,
        block_size, stride_k_blk, stride_k_tok, stride_k_d, stride_v_blk, stride_v_tok,
        stride_v_d, D, qk_scale, False, EVEN_D, CAUSAL, PAGED, UPCAST, DOT_PREC, BLOCK_M, BLOCK_N,
        BLOCK_D,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, row_ok, full_hi, kv_hi, k_ptr, v_ptr, bt_ptr, stride_bt_n,
        block_size, stride_k_blk, stride_k_tok, stride_k_d, stride_v_blk, stride_v_tok,
        stride_v_d, D, qk_scale, True, EVEN_D, CAUSAL, PAGED, UPCAST, DOT_PREC, BLOCK_M, BLOCK_N,
        BLOCK_D,
    )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _store_state(acc, m_i, l_i, o_ptrs, lse_ptrs, o_mask, row_ok, RNE_BF16: tl.constexpr):
    """Normalise and store ``o`` (cast to ``o_ptrs``' dtype) and the natural-log LSE."""
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if RNE_BF16:
        o = round_bf16(o)
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def chunked_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    num_q,
    num_kv,
    q_offset,
    qk_scale,
    D,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_o_t,
    stride_o_s,
    stride_o_h,
    stride_o_d,
    stride_lse_t,
    stride_lse_s,
    stride_lse_h,
    GROUP: tl.constexpr,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(cdiv(num_q, BLOCK_Q), num_kv_heads, num_splits)``.

    Split ``s`` covers keys ``[s * L, (s + 1) * L)`` with ``L = cdiv(num_kv,
    num_splits)`` rounded up to ``BLOCK_N``; its state goes to index ``s`` along
    the output's split stride (a partial buffer; 0 with one split). A split with
    no visible key stores ``(0, -inf)``.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < num_q)
    q_pos = q_offset + tok
    tok64 = tok.to(tl.int64)
    io_ok = row_ok[:, None] & (offs_d[None, :] < D)

    q = tl.load(
        q_ptr
        + tok64[:, None] * stride_q_t
        + head[:, None] * stride_q_h
        + offs_d[None, :] * stride_q_d,
        mask=io_ok,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    kv_hi = num_kv
    if CAUSAL:  # the tile's last query sees keys up to q_offset + last token
        kv_hi = tl.minimum(num_kv, q_offset + tl.minimum(tile * BLOCK_Q + BLOCK_Q, num_q))
    split_len = tl.cdiv(tl.cdiv(num_kv, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(kv_hi, lo + split_len)
    vis_hi = num_kv  # keys every row of the tile sees
    if CAUSAL:
        vis_hi = tl.minimum(num_kv, q_offset + tile * BLOCK_Q + 1)
    acc, m_i, l_i = _attend(
        q,
        q_pos,
        row_ok,
        lo,
        hi,
        vis_hi,
        k_ptr + kv_head * stride_k_h,
        v_ptr + kv_head * stride_v_h,
        k_ptr,
        0,
        1,
        0,
        stride_k_t,
        stride_k_d,
        0,
        stride_v_t,
        stride_v_d,
        D,
        qk_scale,
        EVEN_D,
        CAUSAL,
        False,
        UPCAST,
        DOT_PREC,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
    )
    o_ptrs = (
        o_ptr
        + split * stride_o_s
        + tok64[:, None] * stride_o_t
        + head[:, None] * stride_o_h
        + offs_d[None, :] * stride_o_d
    )
    lse_ptrs = lse_ptr + split * stride_lse_s + tok64 * stride_lse_t + head * stride_lse_h
    _store_state(acc, m_i, l_i, o_ptrs, lse_ptrs, io_ok, row_ok, RNE_BF16)


@triton.jit
def _find_seq(cu_seqlens_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence ``b`` owning tile ``tile_idx``; its tiles start at ``cu[b] // BLOCK_Q + b``."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        if start <= tile_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def paged_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    cu_seqlens_ptr,
    kv_lens_ptr,
    bt_ptr,
    num_seqs,
    block_size,
    qk_scale,
    D,
    stride_bt_b,
    stride_bt_n,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_blk,
    stride_k_tok,
    stride_k_h,
    stride_k_d,
    stride_v_blk,
    stride_v_tok,
    stride_v_h,
    stride_v_d,
    stride_o_t,
    stride_o_s,
    stride_o_h,
    stride_o_d,
    stride_lse_t,
    stride_lse_s,
    stride_lse_h,
    GROUP: tl.constexpr,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(num_q // BLOCK_Q + batch, num_kv_heads, num_splits)``: one query tile of
    one sequence, and one split of its keys.

    Sequence ``b``'s queries are the newest of its ``kv_lens[b]`` keys. With
    ``SKIP_DECODE`` sequences with a single query are left to the split-KV
    decode kernel. Split ``s`` covers keys ``[s * L, (s + 1) * L)`` with ``L =
    cdiv(kv_lens[b], num_splits)`` rounded up to ``BLOCK_N``; its state goes to
    index ``s`` along the output's split stride (a partial buffer; 0 with one
    split). A split with no visible key stores ``(0, -inf)``.
    """
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = _find_seq(cu_seqlens_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_lo = tl.load(cu_seqlens_ptr + b)
    q_hi = tl.load(cu_seqlens_ptr + b + 1)
    num_q = q_hi - q_lo
    first = (tile_idx - (q_lo // BLOCK_Q + b)) * BLOCK_Q  # first local query of the tile
    skip = first >= num_q
    if SKIP_DECODE:
        skip = skip | (num_q == 1)
    if skip:
        return
    kv_len = tl.load(kv_lens_ptr + b)
    q_offset = kv_len - num_q

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    local = first + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (local < num_q)
    q_pos = q_offset + local
    tok64 = (q_lo + local).to(tl.int64)
    io_ok = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(
        q_ptr
        + tok64[:, None] * stride_q_t
        + head[:, None] * stride_q_h
        + offs_d[None, :] * stride_q_d,
        mask=io_ok,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    kv_hi = kv_len
    if CAUSAL:
        kv_hi = tl.minimum(kv_len, q_offset + tl.minimum(first + BLOCK_Q, num_q))
    vis_hi = kv_hi
    if CAUSAL:
        vis_hi = tl.minimum(kv_hi, q_offset + first + 1)
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(kv_hi, lo + split_len)
    acc, m_i, l_i = _attend(
        q,
        q_pos,
        row_ok,
        lo,
        hi,
        vis_hi,
        k_ptr + kv_head * stride_k_h,
        v_ptr + kv_head * stride_v_h,
        bt_ptr + b.to(tl.int64) * stride_bt_b,
        stride_bt_n,
        block_size,
        stride_k_blk,
        stride_k_tok,
        stride_k_d,
        stride_v_blk,
        stride_v_tok,
        stride_v_d,
        D,
        qk_scale,
        EVEN_D,
        CAUSAL,
        True,
        UPCAST,
        DOT_PREC,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
    )
    o_ptrs = (
        o_ptr
        + split * stride_o_s
        + tok64[:, None] * stride_o_t
        + head[:, None] * stride_o_h
        + offs_d[None, :] * stride_o_d
    )
    lse_ptrs = lse_ptr + split * stride_lse_s + tok64 * stride_lse_t + head * stride_lse_h
    _store_state(acc, m_i, l_i, o_ptrs, lse_ptrs, io_ok, row_ok, RNE_BF16)


@triton.jit
def paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_part_ptr,
    lse_part_ptr,
    cu_seqlens_ptr,
    kv_lens_ptr,
    bt_ptr,
    block_size,
    qk_scale,
    D,
    stride_bt_b,
    stride_bt_n,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_blk,
    stride_k_tok,
    stride_k_h,
    stride_k_d,
    stride_v_blk,
    stride_v_tok,
    stride_v_h,
    stride_v_d,
    stride_o_b,
    stride_o_s,
    stride_o_h,
    stride_o_d,
    stride_lse_b,
    stride_lse_s,
    stride_lse_h,
    GROUP: tl.constexpr,
    EVEN_D: tl.constexpr,
    SPLIT_MIN_KV: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(batch, num_kv_heads, MAX_SPLITS)``: split-KV decode into fp32 partials.

    Only sequences with exactly one query run. Sequence ``b`` uses
    ``min(MAX_SPLITS, cdiv(kv_len, SPLIT_MIN_KV))`` splits of ``cdiv(kv_len,
    splits)`` keys rounded up to ``BLOCK_N``; programs past its last split store
    the empty state ``(0, -inf)``. The decode query (the newest token) sees every
    key, causal or not. Partials are ``[batch, MAX_SPLITS, H, D]`` / ``[batch,
    MAX_SPLITS, H]``, reduced by ``merge_states_kernel`` with ``DECODE_ROWS``.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    max_splits = tl.num_programs(2)
    q_lo = tl.load(cu_seqlens_ptr + b)
    q_hi = tl.load(cu_seqlens_ptr + b + 1)
    if q_hi - q_lo != 1:
        return
    kv_len = tl.load(kv_lens_ptr + b)
    num_splits = tl.maximum(tl.minimum(max_splits, tl.cdiv(kv_len, SPLIT_MIN_KV)), 1)
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(kv_len, lo + split_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_m
    row_ok = offs_m < GROUP
    io_ok = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(
        q_ptr
        + q_lo.to(tl.int64) * stride_q_t
        + head[:, None] * stride_q_h
        + offs_d[None, :] * stride_q_d,
        mask=io_ok,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    acc, m_i, l_i = _attend(
        q,
        offs_m,
        row_ok,
        lo,
        hi,
        hi,
        k_ptr + kv_head * stride_k_h,
        v_ptr + kv_head * stride_v_h,
        bt_ptr + b.to(tl.int64) * stride_bt_b,
        stride_bt_n,
        block_size,
        stride_k_blk,
        stride_k_tok,
        stride_k_d,
        stride_v_blk,
        stride_v_tok,
        stride_v_d,
        D,
        qk_scale,
        EVEN_D,
        False,
        True,
        UPCAST,
        DOT_PREC,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
    )
    base = b.to(tl.int64) * stride_o_b + split * stride_o_s
    o_ptrs = o_part_ptr + base + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
    lse_ptrs = (
        lse_part_ptr + b.to(tl.int64) * stride_lse_b + split * stride_lse_s + head * stride_lse_h
    )
    _store_state(acc, m_i, l_i, o_ptrs, lse_ptrs, io_ok, row_ok, False)
