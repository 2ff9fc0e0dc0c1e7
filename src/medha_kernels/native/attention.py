"""CPU attention with LSE from the native extension (``csrc/attention_cpu.cpp``).

One call covers a whole step: a task per (sequence, KV head, query tile) with
the query rows of all heads of one GQA group, online softmax straight over the
block table (no gathered K/V, no copy per GQA group), threads over tasks. The
task list is built once per step by :func:`plan_paged_attention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from medha_kernels.native.jit import get_module

if TYPE_CHECKING:
    from medha_kernels.plan import PagedMeta

_I32 = torch.int32


def plan_paged_attention(meta: PagedMeta):
    """The step's task list, then ``run(q, k_cache, v_cache) -> (o, lse)`` per layer."""
    ext = get_module("cpu")
    lens = meta.kv_lens
    counts = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
    q_start = (lens - counts).to(_I32)  # a chunk is the newest tokens of its sequence
    group = meta.num_qo_heads // meta.num_kv_heads
    tasks = ext.plan_paged_attention(
        meta.cu_seqlens_q, lens, q_start, meta.num_kv_heads, group, meta.causal
    )
    args = (meta.cu_seqlens_q, lens, q_start, meta.block_table, tasks, meta.causal, meta.sm_scale)

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        return ext.paged_attention(
            q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), *args
        )

    return run


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
    from medha_kernels.plan import plan_paged_attention as plan

    return plan(
        cu_seqlens_q=cu_seqlens_q,
        kv_lens=kv_lens,
        block_table=block_table,
        num_qo_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        block_size=k_cache.shape[1],
        dtype=q.dtype,
        causal=causal,
        sm_scale=sm_scale,
        backend="native",
    ).run(q, k_cache, v_cache)


def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.chunked_prefill_attention`: contiguous K/V as one block."""
    num_q, hq, _ = q.shape
    num_kv = k.shape[0]
    if num_kv == 0 or num_q == 0:
        lse = torch.full((num_q, hq), float("-inf"), dtype=torch.float32)
        return q.new_zeros(q.shape), lse
    ext = get_module("cpu")
    cu = torch.tensor([0, num_q], dtype=_I32)
    lens = torch.tensor([num_kv], dtype=_I32)
    start = torch.tensor([q_offset], dtype=_I32)
    table = torch.zeros((1, 1), dtype=_I32)
    group = hq // k.shape[1]
    tasks = ext.plan_paged_attention(cu, lens, start, k.shape[1], group, causal)
    return ext.paged_attention(
        q.contiguous(),
        k.contiguous().unsqueeze(0),
        v.contiguous().unsqueeze(0),
        cu,
        lens,
        start,
        table,
        tasks,
        causal,
        sm_scale,
    )
