"""CPU attention with LSE from the native extension (``csrc/attention_cpu.cpp``).

Large prefill chunks go to torch's CPU flash-attention op instead
(:mod:`medha_kernels.native.cpu_flash`, chosen by measurement). One native call
covers the rest of a step: a task per (sequence, KV head, query tile) with
the query rows of all heads of one GQA group, online softmax straight over the
block table (no gathered K/V, no copy per GQA group), threads over tasks.
Decode sequences get one task for all their KV heads (when there are enough of
them to share out, or one thread), which reads each cache row once, in address
order, and prefetches the next key tile. The task list is built once per step
by :func:`plan_paged_attention`.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

import torch

from medha_kernels._checks import KernelInputError
from medha_kernels.native.cpu_flash import flash_attention, use_flash
from medha_kernels.native.jit import get_module

if TYPE_CHECKING:
    from medha_kernels.plan import PagedMeta

_I32 = torch.int32


def plan_paged_attention(meta: PagedMeta):
    """The step's task list, then ``run(q, k_cache, v_cache) -> (o, lse)`` per layer.

    Sequences with a large prefill chunk (:func:`~medha_kernels.native.cpu_flash.use_flash`)
    go to torch's CPU flash-attention op over their gathered K/V; the rest of the
    step runs in one native call.
    """
    _require_cpu("plan_paged_attention", meta.device)
    counts = meta.query_counts
    flash = {b for b, (n, kv) in enumerate(zip(counts, meta.lens, strict=True)) if use_flash(n, kv)}
    group = meta.num_qo_heads // meta.num_kv_heads
    if not flash:  # every sequence: its chunk starts at kv - n (from the host lists)
        from medha_kernels.plan import host_tensor  # (plan imports the backends)

        q_start = host_tensor([kv - n for n, kv in zip(counts, meta.lens, strict=True)], _I32)
        return _native_run(meta.cu_seqlens_q, meta.kv_lens, meta.block_table, meta, group, q_start)
    rest = [b for b in range(meta.batch) if b not in flash]
    rows = torch.tensor(
        [r for b in rest for r in range(meta.cu[b], meta.cu[b + 1])], dtype=torch.long
    )
    native = None
    if rows.numel():
        pick = torch.tensor(rest, dtype=torch.long)
        cu = torch.tensor([0, *itertools.accumulate(counts[b] for b in rest)], dtype=_I32)
        native = _native_run(cu, meta.kv_lens[pick], meta.block_table[pick], meta, group)
    bs = meta.block_size
    seqs = [
        (meta.cu[b], meta.cu[b + 1], meta.lens[b], meta.block_table[b, : -(-meta.lens[b] // bs)])
        for b in sorted(flash)
    ]
    causal, scale = meta.causal, meta.sm_scale

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        out = torch.empty(q.shape, dtype=q.dtype)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        if native is not None:
            out[rows], lse[rows] = native(q[rows], k_cache, v_cache)
        for lo, hi, kv, blocks in seqs:
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:kv]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:kv]
            out[lo:hi], lse[lo:hi] = flash_attention(q[lo:hi], k, v, kv - (hi - lo), causal, scale)
        return out, lse

    return run


def _require_cpu(op: str, device: torch.device) -> None:
    """The native attention reads host memory: refuse other devices by name (an explicit
    ``backend="native"`` on a GPU would otherwise fail inside the extension)."""
    if device.type != "cpu":
        raise KernelInputError(
            f"native {op} runs on the CPU only; the inputs are on {device} "
            "(use backend='triton' or 'flashinfer' there)"
        )


def _native_run(
    cu: torch.Tensor,
    lens: torch.Tensor,
    table: torch.Tensor,
    meta,
    group: int,
    q_start: torch.Tensor | None = None,
):
    """One native call over the sequences ``cu`` / ``lens`` / ``table`` describe;
    ``q_start``: int32 ``lens - (cu[1:] - cu[:-1])`` if the caller has it."""
    ext = get_module("cpu")
    if q_start is None:
        counts = cu[1:] - cu[:-1]
        q_start = (lens - counts).to(_I32)  # a chunk is the newest tokens of its sequence
    tasks = ext.plan_paged_attention(cu, lens, q_start, meta.num_kv_heads, group, meta.causal)
    # run(q, k_cache, v_cache): the native op with the plan's arguments bound, no Python
    # frame (it makes the three contiguous); a decode step's KVP layers call it cold
    return functools.partial(
        ext.paged_attention_planned, cu, lens, q_start, table, tasks, meta.causal, meta.sm_scale
    )


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

    _require_cpu("paged_attention", q.device)
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
    _require_cpu("chunked_prefill_attention", q.device)
    num_q, hq, _ = q.shape
    num_kv = k.shape[0]
    if num_kv == 0 or num_q == 0:
        lse = torch.full((num_q, hq), float("-inf"), dtype=torch.float32)
        return q.new_zeros(q.shape), lse
    if use_flash(num_q, num_kv) and (not causal or q_offset + num_q <= num_kv):
        if causal and q_offset < 0:
            # rows before key 0 see no key: (0, -inf); the rest start at key 0 (the flash
            # path slices keys from q_offset, which must not be negative)
            skip = min(num_q, -q_offset)
            out = q.new_zeros(q.shape)
            lse = torch.full((num_q, hq), float("-inf"), dtype=torch.float32)
            if skip < num_q:
                out[skip:], lse[skip:] = chunked_prefill_attention(
                    q[skip:], k, v, 0, causal, sm_scale
                )
            return out, lse
        return flash_attention(q, k, v, q_offset, causal, sm_scale)
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
