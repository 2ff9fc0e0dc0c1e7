"""Attention with LSE over contiguous or paged KV, in plain torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from medha_kernels.torch_ref.merge import merge_states

if TYPE_CHECKING:
    from medha_kernels.plan import PagedMeta

KV_TILE = 4096  # keys per tile, at most
MIN_KV_TILE = 256  # keys per tile, at least (unless KV_TILE is smaller)
Q_TILE = 1024  # queries per tile
# Scores per tile (num_q * num_heads * keys), about 2 MiB in fp32: a tile's
# temporaries stay in cache instead of streaming through memory. On a 2-core
# VM a 512-token chunk over 23K keys ran 2-3x faster, and steadier, with
# 512-key tiles than with 4096-key ones.
SCORE_TILE = 1 << 19


def kv_tile(num_q: int, num_heads: int) -> int:
    """Keys per tile for ``num_q`` query rows of ``num_heads`` heads."""
    fit = SCORE_TILE // max(1, num_q * num_heads)
    return min(KV_TILE, max(MIN_KV_TILE, fit))


def _attend_tile(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor | None, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV tile: q ``[Nq, Hq, D]`` (compute dtype), k/v ``[Nk, Hq, D]``.

    ``limit[i]`` is the last key index query i may see (causal), or None.
    """
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if limit is not None:
        keys = torch.arange(k.shape[0], device=q.device)
        allowed = keys.view(1, -1) <= limit.view(-1, 1)  # [Nq, Nk]
        scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Nq]
    finite = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(finite, lse, 0).unsqueeze(-1))
    p = torch.where(finite.unsqueeze(-1), p, 0)
    o = torch.einsum("hqk,khd->qhd", p, v)
    return o, lse.transpose(0, 1)


def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.chunked_prefill_attention` (arguments already checked).

    Queries go in tiles of ``Q_TILE`` rows and keys in tiles of
    :func:`kv_tile` keys (at most ``KV_TILE``), so memory stays bounded for a
    whole long prompt; with ``causal`` a query tile skips the key tiles that
    are masked for all of its rows.
    """
    num_q = q.shape[0]
    if num_q <= Q_TILE:
        return _attend_rows(q, k, v, q_offset, causal, sm_scale)
    parts = [
        _attend_rows(q[lo : lo + Q_TILE], k, v, q_offset + lo, causal, sm_scale)
        for lo in range(0, num_q, Q_TILE)
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def _attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query tile q ``[Nq, Hq, D]`` over k/v ``[Nk, Hkv, D]``.

    Key tiles that every row sees whole skip the causal mask.
    """
    num_q, hq, _ = q.shape
    group = hq // k.shape[1]
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc = q.to(cdtype)
    last = torch.arange(num_q, device=q.device) + q_offset if causal else None
    # with causal masking no row sees a key past the last row's position
    num_keys = min(k.shape[0], q_offset + num_q) if causal else k.shape[0]
    tile = kv_tile(num_q, hq)
    outs, lses = [], []
    for start in range(0, num_keys, tile):
        kt = k[start : start + tile].to(cdtype).repeat_interleave(group, dim=1)
        vt = v[start : start + tile].to(cdtype).repeat_interleave(group, dim=1)
        # the first row (the most restricted) sees keys up to q_offset
        masked = causal and start + kt.shape[0] - 1 > q_offset
        o, lse = _attend_tile(qc, kt, vt, last - start if masked else None, sm_scale)
        outs.append(o)
        lses.append(lse)
    if not outs:  # no keys at all: every row is empty
        lse_dtype = torch.float64 if cdtype == torch.float64 else torch.float32
        return q.new_zeros(q.shape), torch.full(
            (num_q, hq), float("-inf"), dtype=lse_dtype, device=q.device
        )
    o, lse = merge_states(torch.stack(outs, dim=1), torch.stack(lses, dim=1))
    return o.to(q.dtype), lse


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.paged_attention` (arguments already checked)."""
    blocks = _sequence_blocks(block_table, kv_lens.tolist(), k_cache.shape[1])
    return _run_paged(q, k_cache, v_cache, cu_seqlens_q.tolist(), blocks, causal, sm_scale)


def plan_paged_attention(meta: PagedMeta):
    """The plan/run form: each sequence's block ids are sliced once per step."""
    blocks = _sequence_blocks(meta.block_table, meta.lens, meta.block_size)

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        return _run_paged(q, k_cache, v_cache, meta.cu, blocks, meta.causal, meta.sm_scale)

    return run


def _sequence_blocks(
    block_table: torch.Tensor, lens: list[int], block_size: int
) -> list[tuple[int, torch.Tensor]]:
    """``(kv_len, int64 block ids)`` per sequence."""
    return [(n, block_table[b, : -(-n // block_size)].long()) for b, n in enumerate(lens)]


def _run_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu: list[int],
    blocks: list[tuple[int, torch.Tensor]],
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk at a time over each sequence's gathered K/V (the reference loop)."""
    out = torch.empty_like(q)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.empty(q.shape[:2], dtype=lse_dtype, device=q.device)
    for b, (kv_len, ids) in enumerate(blocks):
        lo, hi = cu[b], cu[b + 1]
        k = k_cache[ids].flatten(0, 1)[:kv_len]
        v = v_cache[ids].flatten(0, 1)[:kv_len]
        o_b, lse_b = chunked_prefill_attention(q[lo:hi], k, v, kv_len - (hi - lo), causal, sm_scale)
        out[lo:hi] = o_b
        lse[lo:hi] = lse_b
    return out, lse
