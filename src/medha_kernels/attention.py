"""Attention with LSE for chunked prefill and decode.

Conventions (FlashInfer-compatible layouts, natural-log LSE):

- tokens first: ``q`` is ``[num_q, num_qo_heads, head_dim]``;
- grouped-query attention: query head ``h`` reads KV head
  ``h // (num_qo_heads // num_kv_heads)``;
- the LSE is fp32 ``[num_q, num_qo_heads]``; a query that sees no key gets
  ``(0, -inf)``, never NaN;
- causal masking is bottom-right: query ``i`` sits at absolute position
  ``q_offset + i`` and sees keys ``j <= q_offset + i``::

      keys:     0 1 2 3 4 5      (num_kv = 6, num_q = 2, q_offset = 4)
      query 0:  x x x x x .
      query 1:  x x x x x x
"""

from __future__ import annotations

import operator

import torch

from medha_kernels._checks import (
    KernelInputError,
    check_gqa,
    check_shape,
    check_tensor,
    default_sm_scale,
)
from medha_kernels.backends import resolve
from medha_kernels.plan import _plan, _validate, check_q_and_cache

_Q = "[num_q, num_qo_heads, head_dim]"
_KV = "[num_kv, num_kv_heads, head_dim]"


def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_offset: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence's query chunk over contiguous KV.

    Args:
        q: ``[num_q, num_qo_heads, head_dim]``, fp16, bf16 or fp32.
        k: ``[num_kv, num_kv_heads, head_dim]``, same dtype and device.
        v: ``[num_kv, num_kv_heads, head_dim]``, same dtype and device.
        q_offset: absolute position of query 0; default ``num_kv - num_q``
            (the chunk is the newest tokens).
        causal: query ``i`` sees keys ``j <= q_offset + i``; without it every
            key (how a KV shard lying before the chunk is computed).
        sm_scale: default ``1 / sqrt(head_dim)``.
        backend: ``"auto"``, ``"torch"``, ``"native"`` (CPU), ``"triton"`` or ``"flashinfer"``.

    Returns:
        ``(o, lse)``: ``[num_q, num_qo_heads, head_dim]`` in ``q``'s dtype, and
        ``[num_q, num_qo_heads]`` fp32 natural-log LSE.
    """
    check_tensor("q", q, layout=_Q)
    check_tensor("k", k, layout=_KV, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, layout=_KV, dtypes=(q.dtype,), device=q.device)
    check_shape("v", v, tuple(k.shape), _KV)
    if k.shape[2] != q.shape[2]:
        raise KernelInputError(f"k: head_dim {k.shape[2]} differs from q's {q.shape[2]}")
    check_gqa(q.shape[1], k.shape[1])
    if q.shape[2] < 1:
        raise KernelInputError(f"q: head_dim must be >= 1, got shape {tuple(q.shape)}")
    offset = k.shape[0] - q.shape[0] if q_offset is None else _position(q_offset)
    scale = default_sm_scale(q.shape[2], sm_scale)
    args = (q, k, v, offset, bool(causal), scale)
    return resolve("chunked_prefill_attention", backend, q.device, args)(*args)


def _position(q_offset: object) -> int:
    """``q_offset`` as an int; a KernelInputError unless it is an integer (1.7 was taken as 1)."""
    try:
        if not isinstance(q_offset, bool):
            return operator.index(q_offset)  # type: ignore[arg-type]
    except TypeError:
        pass
    raise KernelInputError(f"q_offset must be an integer, got {q_offset!r}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention for a batch mixing prefill chunks and decodes over a paged KV cache.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, which
    are the newest of its ``kv_lens[b]`` keys (already written to the cache).
    Its keys live in blocks ``block_table[b, :ceil(kv_lens[b] / block_size)]``,
    in any order in the cache.

    Args:
        q: ``[num_q, num_qo_heads, head_dim]``, fp16, bf16 or fp32.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD), q's dtype.
        v_cache: like ``k_cache``.
        cu_seqlens_q: ``[batch + 1]`` int32, from 0 to ``num_q``, non-decreasing.
        kv_lens: ``[batch]`` int32, each ``>=`` its number of queries.
        block_table: ``[batch, max_blocks]`` int32.
        causal: see :func:`chunked_prefill_attention`.
        sm_scale: default ``1 / sqrt(head_dim)``.
        backend: ``"auto"``, ``"torch"``, ``"native"`` (CPU), ``"triton"`` or ``"flashinfer"``.

    Returns:
        ``(o, lse)`` as for :func:`chunked_prefill_attention`.

    Layers of one step share their metadata: plan it once with
    :func:`medha_kernels.plan_paged_attention` and ``run`` the plan per layer
    instead (this function plans and runs in one call).
    """
    check_q_and_cache(q, k_cache, v_cache)
    meta = _validate(
        cu_seqlens_q,
        kv_lens,
        block_table,
        num_qo_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        block_size=k_cache.shape[1],
        dtype=q.dtype,
        causal=causal,
        sm_scale=sm_scale,
        num_q=q.shape[0],
    )
    return _plan(meta, backend).run(q, k_cache, v_cache)
