"""Writing new K/V into a paged cache."""

from __future__ import annotations

import torch

from medha_kernels._checks import KernelInputError, check_shape, check_tensor
from medha_kernels.backends import resolve

_KV = "[num_tokens, num_kv_heads, head_dim]"
_CACHE = "[num_blocks, block_size, num_kv_heads, head_dim]"


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slots: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Write token ``i``'s K and V into cache slot ``slots[i]``.

    Args:
        k: ``[num_tokens, num_kv_heads, head_dim]``, fp16, bf16 or fp32.
        v: like ``k``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; written.
        v_cache: like ``k_cache``; written.
        slots: ``[num_tokens]`` int32, ``block * block_size + offset``; a
            negative slot skips that token (padding).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """
    check_tensor("k", k, layout=_KV)
    check_tensor("v", v, layout=_KV, dtypes=(k.dtype,), device=k.device)
    check_shape("v", v, tuple(k.shape), _KV)
    check_tensor("k_cache", k_cache, layout=_CACHE, device=k.device)
    check_tensor("v_cache", v_cache, layout=_CACHE, dtypes=(k_cache.dtype,), device=k.device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape), _CACHE)
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise KernelInputError(
            f"k_cache: heads and head_dim {tuple(k_cache.shape[2:])} "
            f"differ from k's {tuple(k.shape[1:])}"
        )
    check_tensor("slots", slots, layout="[num_tokens]", dtypes=(torch.int32,), device=k.device)
    check_shape("slots", slots, (k.shape[0],), "[num_tokens]")
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel() and int(slots.max()) >= capacity:
        raise KernelInputError(f"slots: {int(slots.max())} is past the cache's {capacity} slots")
    args = (k, v, k_cache, v_cache, slots)
    resolve("append_paged_kv", backend, k.device, args)(*args)
