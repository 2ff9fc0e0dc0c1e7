"""Launchers for the attention kernels (arguments already validated).

Tiling: a program owns ``BLOCK_M = max(64, next_pow2(group))`` rows, that is
``BLOCK_Q = BLOCK_M // group`` query tokens x the ``group`` query heads of one
KV head, against ``BLOCK_N``-key tiles; the head dim is padded to a power of two.

Split-KV: a decode (a sequence with one query) in :func:`paged_attention`
splits its keys into ``min(MAX_SPLITS, cdiv(kv_len, SPLIT_MIN_KV))`` chunks run
by separate programs, then merged by the N-way merge kernel.
:func:`chunked_prefill_attention` splits the same way when its query tiles
alone would leave the device idle.
"""

from __future__ import annotations

import math

import torch
import triton

from medha_kernels.triton._common import block_d, interpreting, rne_bf16
from medha_kernels.triton.kernels.attention import (
    chunked_prefill_kernel,
    paged_decode_kernel,
    paged_prefill_kernel,
)
from medha_kernels.triton.merge import launch_merge_states

MAX_SPLITS = 16  # most KV splits per sequence
SPLIT_MIN_KV = 128  # fewest keys worth a split of their own
_LOG2E = 1.0 / math.log(2.0)


def _tiles(group: int, head_dim: int) -> dict:
    bd = block_d(head_dim)
    bm = max(64, triton.next_power_of_2(group))
    return {
        "BLOCK_M": bm,
        "BLOCK_Q": bm // group,
        "BLOCK_N": 64 if bd <= 128 else 32,
        "BLOCK_D": bd,
    }


def _flags(dtype: torch.dtype) -> dict:
    interp = interpreting()
    return {
        "UPCAST": interp and dtype != torch.float32,
        # fp32 inputs (and interpreter upcasts) get true fp32 dots, not TF32.
        "DOT_PREC": "ieee" if interp or dtype == torch.float32 else "tf32",
    }


def _launch_opts() -> dict:
    return {} if interpreting() else {"num_warps": 4, "num_stages": 2}


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 64


def num_kv_splits(num_kv: int, programs: int, target: int) -> int:
    """KV splits for a launch with ``programs`` (query tile, KV head) programs."""
    if programs >= target:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(num_kv, SPLIT_MIN_KV), triton.cdiv(target, programs)))


def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.chunked_prefill_attention`."""
    num_q, num_heads, head_dim = q.shape
    num_kv, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((num_q, num_heads), dtype=torch.float32, device=q.device)
    if num_q == 0 or num_heads == 0:
        return out, lse
    tiles = _tiles(group, head_dim)
    q_tiles = triton.cdiv(num_q, tiles["BLOCK_Q"])
    splits = num_kv_splits(num_kv, q_tiles * num_kv_heads, _target_programs(q.device))
    if splits > 1:  # fp32 partial states [num_q, splits, H, D], merged below
        o_dst = torch.empty(
            (num_q, splits, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        lse_dst = torch.empty((num_q, splits, num_heads), dtype=torch.float32, device=q.device)
        o_strides, lse_strides = o_dst.stride(), lse_dst.stride()
    else:
        o_dst, lse_dst = out, lse
        o_strides = (out.stride(0), 0, out.stride(1), out.stride(2))
        lse_strides = (lse.stride(0), 0, lse.stride(1))
    chunked_prefill_kernel[(q_tiles, num_kv_heads, splits)](
        q,
        k,
        v,
        o_dst,
        lse_dst,
        num_q,
        num_kv,
        q_offset,
        sm_scale * _LOG2E,
        head_dim,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *o_strides,
        *lse_strides,
        GROUP=group,
        CAUSAL=causal,
        RNE_BF16=splits == 1 and rne_bf16(q.dtype),
        **_flags(q.dtype),
        **tiles,
        **_launch_opts(),
    )
    if splits > 1:
        launch_merge_states(o_dst, lse_dst, out, lse)
    return out, lse


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
    """See :func:`medha_kernels.paged_attention`.

    Two launches plus a merge: query tiles of sequences with several queries
    (prefill chunks), and split-KV programs for single-query sequences (decodes)
    whose partials the N-way merge kernel reduces into their output rows.
    """
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch = kv_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((num_q, num_heads), dtype=torch.float32, device=q.device)
    if num_q == 0 or num_heads == 0 or batch == 0:
        return out, lse
    cu = cu_seqlens_q.contiguous()
    lens = kv_lens.contiguous()
    flags = _flags(q.dtype)
    strides = (
        *block_table.stride(),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
    )

    tiles = _tiles(group, head_dim)
    paged_prefill_kernel[(num_q // tiles["BLOCK_Q"] + batch, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        lse,
        cu,
        lens,
        block_table,
        batch,
        k_cache.shape[1],
        sm_scale * _LOG2E,
        head_dim,
        *strides,
        *out.stride(),
        *lse.stride(),
        GROUP=group,
        CAUSAL=causal,
        SKIP_DECODE=True,
        RNE_BF16=rne_bf16(q.dtype),
        **flags,
        **tiles,
        **_launch_opts(),
    )

    bd = block_d(head_dim)
    o_part = torch.empty(
        (batch, MAX_SPLITS, num_heads, head_dim), dtype=torch.float32, device=q.device
    )
    lse_part = torch.empty((batch, MAX_SPLITS, num_heads), dtype=torch.float32, device=q.device)
    paged_decode_kernel[(batch, num_kv_heads, MAX_SPLITS)](
        q,
        k_cache,
        v_cache,
        o_part,
        lse_part,
        cu,
        lens,
        block_table,
        k_cache.shape[1],
        sm_scale * _LOG2E,
        head_dim,
        *strides,
        *o_part.stride(),
        *lse_part.stride(),
        GROUP=group,
        SPLIT_MIN_KV=SPLIT_MIN_KV,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles["BLOCK_N"],
        BLOCK_D=bd,
        **flags,
        **_launch_opts(),
    )
    launch_merge_states(o_part, lse_part, out, lse, cu_seqlens=cu)
    return out, lse
