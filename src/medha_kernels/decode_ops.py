"""A decode step's small CPU ops in one native call each: rotary in place, the paged K/V write.

At a decode step's one token row, torch's rotary (five dispatched ops a layer)
and K/V write (two ``index_copy_``) cost far more than their arithmetic. For
CPU tensors the native kernels (``native/csrc/rotary_kv_cpu.cpp``) do each in
one call with the same result: the rotation rounds each product and the sum
once as torch does (bit-identical), the write is a copy. Each function returns
whether it ran; False (other dtypes or devices, no compiler here,
``MEDHA_NATIVE_DECODE_OPS=0``, read once per process at the first call) leaves
the work to the caller's torch path.
"""

from __future__ import annotations

import functools

import torch

_F32 = torch.float32
_I64 = torch.int64


@functools.cache
def _module():
    """The native extension, or None where it cannot run (builds on first use; cached)."""
    from medha_kernels import native

    return native.cpu_module("MEDHA_NATIVE_DECODE_OPS")


def rotary_(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> bool:
    """Rotate ``x`` in place natively if it can (as ``medha_runtime.model.rope.apply_rotary_``).

    Args:
        x: ``[num_tokens, num_heads, head_dim]`` fp32 on the CPU, the last dimension
            contiguous (any other strides); written.
        cos2, sin2: ``[num_tokens, 1, 2, head_dim // 2]`` fp32 from
            :func:`medha_runtime.model.rope.rotary_tables` (``cos`` twice, ``(-sin, sin)``:
            the kernel reads ``sin2[:, :, 1]`` and negates it for the first half);
            other shapes (tables broadcast over tokens) return False.

    Returns:
        Whether ``x`` was rotated (False: nothing was done).
    """
    if (
        x.dtype is _F32
        and cos2.dtype is _F32
        and sin2.dtype is _F32
        and x.is_cpu
        and x.dim() == 3
        and x.stride(2) == 1
        and cos2.is_cpu
        and sin2.is_cpu
        # one table row per token, as rotary_tables makes them (no broadcasting)
        and cos2.shape == sin2.shape == (x.shape[0], 1, 2, x.shape[2] // 2)
        and not (torch.is_grad_enabled() and x.requires_grad)
    ):
        module = _module()
        if module is not None:
            module.rotary_(x, cos2, sin2)
            return True
    return False


def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A step's rotary tables natively if it can, as ``medha_runtime.model.rope`` makes
    them in fp32: ``rotary_tables(*RotaryEmbedding.cos_sin(positions))``, the same torch
    ops from C++ (the same bits) in one call instead of a dozen.

    Args:
        positions: ``[N]`` int64 on the CPU.
        inv_freq: ``[D / 2]`` fp32 on the CPU, contiguous.
        scale: multiplies cos and sin (unless it is 1).

    Returns:
        ``(cos2, sin2)``, each ``[N, 1, 2, D / 2]`` fp32 (``cos2`` a broadcast view), or
        None (nothing done) for other tensors or where the native ops do not run.
    """
    if positions.is_cpu and positions.dtype is _I64 and inv_freq.dtype is _F32:
        module = _module()
        if module is not None:
            return module.rotary_tables(positions, inv_freq, scale)
    return None


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
) -> bool:
    """Copy ``k``, ``v`` row ``i`` to slot ``index[i]`` of the caches natively if it can.

    Args:
        k, v: ``[N, num_kv_heads, head_dim]``, the last dimension contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous, ``k``'s dtype; written.
        index: ``[N]`` int64 slots (each checked against the cache).

    Returns:
        Whether the rows were written (False: nothing was done).
    """
    if (
        k.is_cpu
        and k_cache.is_cpu
        and index.dtype is _I64
        and index.is_cpu
        and index.dim() == 1
        and index.is_contiguous()
        and k.dtype == k_cache.dtype
        and k.dim() == 3
        and v.dim() == 3
        and k.stride(2) == 1
        and v.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.shape == k_cache.shape
        and v_cache.dtype == k_cache.dtype
        and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))
    ):
        module = _module()
        if module is not None:
            module.write_kv(k, v, k_cache, v_cache, index)
            return True
    return False
