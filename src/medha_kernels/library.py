"""The public ops as ``torch.library`` custom ops (``torch.ops.medha.*``), with fake kernels.

Importing this module registers, once per process, in the ``medha`` namespace:

======================================  ==============================================
op                                      Python function it calls
======================================  ==============================================
``medha::chunked_prefill_attention``    :func:`medha_kernels.chunked_prefill_attention`
``medha::paged_attention``              :func:`medha_kernels.paged_attention`
``medha::merge_state``                  :func:`medha_kernels.merge_state`
``medha::merge_state_in_place``         :func:`medha_kernels.merge_state_in_place`
``medha::merge_states``                 :func:`medha_kernels.merge_states`
``medha::append_paged_kv``              :func:`medha_kernels.append_paged_kv`
======================================  ==============================================

Each op takes the function's arguments positionally (keyword-only ones
included, ``backend`` last) and returns what it returns, and each has a fake
kernel that gives the outputs' shapes and dtypes without computing them. So
``torch.compile(fullgraph=True)``, ``torch.export`` and FakeTensor tracing see
one opaque node per call instead of breaking the graph at the kernel's Python
dispatch (host-side checks, backend choice). The in-place ops declare what
they mutate (``v`` and ``s``; the two caches).

The ops are for graphs. Eager code should call the Python functions (or a
:class:`~medha_kernels.PagedAttentionPlan`): the dispatcher costs about 0.2 ms
per call on the development CPU (``docs/benchmarks.md``), several times a
small decode's kernel, which is why ``medha_runtime`` calls them directly.
No op registers autograd: they are inference kernels.
"""

from __future__ import annotations

import torch
from torch.library import custom_op, register_fake

from medha_kernels.attention import chunked_prefill_attention as _chunked_prefill_attention
from medha_kernels.attention import paged_attention as _paged_attention
from medha_kernels.merge import merge_state as _merge_state
from medha_kernels.merge import merge_state_in_place as _merge_state_in_place
from medha_kernels.merge import merge_states as _merge_states
from medha_kernels.paged_kv import append_paged_kv as _append_paged_kv

__all__ = [
    "append_paged_kv",
    "chunked_prefill_attention",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "paged_attention",
]

Pair = tuple[torch.Tensor, torch.Tensor]


def _fresh(t: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where it shares storage with an input (custom ops must not alias)."""
    base = t.untyped_storage().data_ptr()
    if t.numel() and any(x.numel() and x.untyped_storage().data_ptr() == base for x in inputs):
        return t.clone()
    return t


def _attention_out(q: torch.Tensor) -> Pair:
    """Fake ``(o, lse)``: ``[num_q, num_qo_heads, head_dim]`` in q's dtype and
    ``[num_q, num_qo_heads]`` fp32."""
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@custom_op("medha::chunked_prefill_attention", mutates_args=())
def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
    backend: str = "auto",
) -> Pair:
    """:func:`medha_kernels.chunked_prefill_attention` as an op (same shapes and dtypes)."""
    o, lse = _chunked_prefill_attention(
        q, k, v, q_offset=q_offset, causal=causal, sm_scale=sm_scale, backend=backend
    )
    return _fresh(o, q, k, v), _fresh(lse, q, k, v)


@register_fake("medha::chunked_prefill_attention")
def _(q, k, v, q_offset=None, causal=True, sm_scale=None, backend="auto"):
    return _attention_out(q)


@custom_op("medha::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    backend: str = "auto",
) -> Pair:
    """:func:`medha_kernels.paged_attention` as an op (same shapes and dtypes)."""
    o, lse = _paged_attention(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q,
        kv_lens=kv_lens,
        block_table=block_table,
        causal=causal,
        sm_scale=sm_scale,
        backend=backend,
    )
    return _fresh(o, q, k_cache, v_cache), _fresh(lse, q)


@register_fake("medha::paged_attention")
def _(q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_table, causal=True, sm_scale=None,
      backend="auto"):  # fmt: skip
    return _attention_out(q)


@custom_op("medha::merge_state", mutates_args=())
def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    backend: str = "auto",
) -> Pair:
    """:func:`medha_kernels.merge_state` as an op: ``[T, H, D]`` in v_a's dtype, ``[T, H]`` fp32."""
    v, s = _merge_state(v_a, s_a, v_b, s_b, backend=backend)
    return _fresh(v, v_a, v_b), _fresh(s, s_a, s_b)


@register_fake("medha::merge_state")
def _(v_a, s_a, v_b, s_b, backend="auto"):
    return torch.empty_like(v_a), torch.empty_like(s_a)


@custom_op("medha::merge_state_in_place", mutates_args=("v", "s"))
def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """:func:`medha_kernels.merge_state_in_place` as an op (mutates ``v`` and ``s``)."""
    _merge_state_in_place(v, s, v_other, s_other, mask=mask, backend=backend)


@register_fake("medha::merge_state_in_place")
def _(v, s, v_other, s_other, mask=None, backend="auto"):
    return None


@custom_op("medha::merge_states", mutates_args=())
def merge_states(v: torch.Tensor, s: torch.Tensor, backend: str = "auto") -> Pair:
    """:func:`medha_kernels.merge_states` as an op: ``[T, H, D]`` in v's dtype, ``[T, H]`` fp32."""
    out_v, out_s = _merge_states(v, s, backend=backend)
    return _fresh(out_v, v), _fresh(out_s, s)


@register_fake("medha::merge_states")
def _(v, s, backend="auto"):
    t, _, h, d = v.shape
    return v.new_empty((t, h, d)), s.new_empty((t, h))


@custom_op("medha::append_paged_kv", mutates_args=("k_cache", "v_cache"))
def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    backend: str = "auto",
) -> None:
    """:func:`medha_kernels.append_paged_kv` as an op (mutates both caches)."""
    _append_paged_kv(k, v, k_cache, v_cache, slots=slots, backend=backend)


@register_fake("medha::append_paged_kv")
def _(k, v, k_cache, v_cache, slots, backend="auto"):
    return None
