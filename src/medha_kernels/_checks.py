"""Input validation shared by every op: errors name the tensor and what was expected."""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KernelInputError(ValueError):
    """An op's input has the wrong rank, shape, dtype or device."""


def check_tensor(
    name: str,
    t: object,
    *,
    layout: str,
    dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``t`` is a tensor of rank ``len(layout)`` and an allowed dtype.

    ``layout`` is written like ``"[num_tokens, num_heads, head_dim]"``.
    """
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name}: expected a tensor {layout}, got {type(t).__name__}")
    ndim = layout.count(",") + 1
    if t.dim() != ndim:
        raise KernelInputError(
            f"{name}: expected a {ndim}-D tensor {layout}, got shape {tuple(t.shape)}"
        )
    allowed = tuple(dtypes)
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise KernelInputError(f"{name}: expected dtype {names}, got {t.dtype}")
    if device is not None and t.device != device:
        raise KernelInputError(f"{name}: expected device {device}, got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise KernelInputError(
            f"{name}: expected shape {tuple(expected)} {layout}, got {tuple(t.shape)}"
        )


def check_gqa(num_qo_heads: int, num_kv_heads: int) -> int:
    """The number of query heads per KV head; raises unless it is a whole number."""
    if num_qo_heads < 1 or num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise KernelInputError(
            f"num_qo_heads={num_qo_heads} must be a positive multiple of "
            f"num_kv_heads={num_kv_heads} (grouped-query attention)"
        )
    return num_qo_heads // num_kv_heads


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    return head_dim**-0.5 if sm_scale is None else float(sm_scale)
