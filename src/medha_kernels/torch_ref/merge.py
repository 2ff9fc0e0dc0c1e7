"""Merging partial attention states (v, s) in plain torch.

``s`` is a natural-log LSE. An LSE of -inf, +inf or NaN marks an empty state,
whose ``v`` is ignored even if it holds garbage. Weights are exp(s - max s),
never exp(s), so any common offset is exact.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _clean(s: torch.Tensor) -> torch.Tensor:
    """LSE in the compute dtype with +inf and NaN mapped to -inf (empty)."""
    s = s.to(torch.float64 if s.dtype == torch.float64 else torch.float32)
    return torch.where(torch.isfinite(s), s, torch.full_like(s, NEG_INF))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``N`` states: v ``[T, N, H, D]``, s ``[T, N, H]`` -> ``[T, H, D]``, ``[T, H]``."""
    s = _clean(s)
    cdtype = s.dtype
    m = (
        s.amax(dim=1, keepdim=True)
        if s.shape[1]
        else s.new_full((s.shape[0], 1, s.shape[2]), NEG_INF)
    )
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(s - m_safe)  # exp(-inf) = 0 for empty states
    total = w.sum(dim=1)  # [T, H]
    vw = torch.where(
        w.unsqueeze(-1) > 0, v.to(cdtype), torch.zeros((), dtype=cdtype, device=v.device)
    )
    num = (vw * w.unsqueeze(-1)).sum(dim=1)
    nonempty = total > 0
    out = torch.where(
        nonempty.unsqueeze(-1), num / torch.where(nonempty, total, 1).unsqueeze(-1), 0
    )
    lse = torch.where(nonempty, m.squeeze(1) + torch.log(torch.where(nonempty, total, 1)), NEG_INF)
    out_dtype = torch.float32 if s.dtype == torch.float32 else torch.float64
    return out.to(v.dtype), lse.to(out_dtype)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states of shape ``[T, H, D]`` / ``[T, H]``."""
    return merge_states(torch.stack((v_a, v_b), dim=1), torch.stack((s_a, s_b), dim=1))


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)``; rows where ``mask`` is False are untouched."""
    v_new, s_new = merge_state(v, s, v_other, s_other)
    if mask is None:
        v.copy_(v_new)
        s.copy_(s_new)
        return
    rows = mask.nonzero(as_tuple=True)[0]
    v.index_copy_(0, rows, v_new.index_select(0, rows))
    s.index_copy_(0, rows, s_new.index_select(0, rows))
