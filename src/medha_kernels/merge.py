"""Merging partial attention states: the exact combination behind KV parallelism.

A state is ``(v, s)``: an attention output over some set of keys and the
natural-log log-sum-exp of its scores. Two states over disjoint key sets merge
into the state over their union::

    m = max(s_a, s_b);  w_x = exp(s_x - m)
    v = (w_a v_a + w_b v_b) / (w_a + w_b);  s = m + log(w_a + w_b)

An empty state is ``(0, -inf)``; an LSE of +inf or NaN also counts as empty and
its ``v`` is ignored. Merging two empty states gives ``(0, -inf)``.
"""

from __future__ import annotations

import torch

from medha_kernels._checks import KernelInputError, check_shape, check_tensor
from medha_kernels.backends import resolve

_V3 = "[num_tokens, num_heads, head_dim]"
_S2 = "[num_tokens, num_heads]"
_F32 = (torch.float32,)


def _check_pair(prefix: str, v: torch.Tensor, s: torch.Tensor, like: torch.Tensor | None) -> None:
    check_tensor(f"{prefix}v", v, layout=_V3, device=None if like is None else like.device)
    check_tensor(f"{prefix}s", s, layout=_S2, dtypes=_F32, device=v.device)
    check_shape(f"{prefix}s", s, tuple(v.shape[:2]), _S2)
    if like is not None:
        check_shape(f"{prefix}v", v, tuple(like.shape), _V3)
        if v.dtype != like.dtype:
            raise KernelInputError(
                f"{prefix}v: expected dtype {like.dtype} like the other state, got {v.dtype}"
            )


def merge_state(
    v_a: torch.Tensor,
    s_a: torch.Tensor,
    v_b: torch.Tensor,
    s_b: torch.Tensor,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states.

    Args:
        v_a: ``[num_tokens, num_heads, head_dim]``, fp16, bf16 or fp32.
        s_a: ``[num_tokens, num_heads]`` fp32, natural-log LSE of ``v_a``.
        v_b: like ``v_a``.
        s_b: like ``s_a``.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"native"`` or ``"flashinfer"``.

    Returns:
        ``(v, s)``: ``[num_tokens, num_heads, head_dim]`` in ``v_a``'s dtype and
        ``[num_tokens, num_heads]`` fp32.

    >>> import torch
    >>> ones, zeros = torch.ones(2, 1, 4), torch.zeros(2, 1, 4)
    >>> v, s = merge_state(ones, torch.zeros(2, 1), zeros, torch.zeros(2, 1))
    >>> v[0, 0, 0].item(), round(s[0, 0].item(), 4)
    (0.5, 0.6931)
    """
    _check_pair("", v_a, s_a, None)
    _check_pair("b: ", v_b, s_b, v_a)
    args = (v_a, s_a, v_b, s_b)
    return resolve("merge_state", backend, v_a.device, args)(*args)


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place.

    Args:
        v: ``[num_tokens, num_heads, head_dim]``, fp16, bf16 or fp32; updated.
        s: ``[num_tokens, num_heads]`` fp32; updated.
        v_other: like ``v``.
        s_other: like ``s``.
        mask: optional ``[num_tokens]`` bool; rows where it is False stay
            bit-identical.
        backend: see :func:`merge_state`.
    """
    _check_pair("", v, s, None)
    _check_pair("other: ", v_other, s_other, v)
    if mask is not None:
        check_tensor("mask", mask, layout="[num_tokens]", dtypes=(torch.bool,), device=v.device)
        check_shape("mask", mask, (v.shape[0],), "[num_tokens]")
    args = (v, s, v_other, s_other, mask)
    resolve("merge_state_in_place", backend, v.device, args)(*args)


def merge_states(
    v: torch.Tensor, s: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` states per token and head.

    Args:
        v: ``[num_tokens, num_states, num_heads, head_dim]``, fp16, bf16 or fp32.
        s: ``[num_tokens, num_states, num_heads]`` fp32.
        backend: see :func:`merge_state`.

    Returns:
        ``(v, s)``: ``[num_tokens, num_heads, head_dim]`` in ``v``'s dtype and
        ``[num_tokens, num_heads]`` fp32. With ``num_states == 0`` every row is
        ``(0, -inf)``.
    """
    layout_v = "[num_tokens, num_states, num_heads, head_dim]"
    layout_s = "[num_tokens, num_states, num_heads]"
    check_tensor("v", v, layout=layout_v)
    check_tensor("s", s, layout=layout_s, dtypes=_F32, device=v.device)
    check_shape("s", s, tuple(v.shape[:3]), layout_s)
    return resolve("merge_states", backend, v.device, (v, s))(v, s)
