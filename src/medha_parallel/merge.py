"""The exact merge of partial attention states over disjoint key sets (pure torch).

A partial state is ``(out, lse)``: attention over some keys and the
natural-log log-sum-exp of their scores. ``N`` states over disjoint key sets
merge into the state over their union::

    lse = log(sum_n exp(lse_n))
    out = sum_n exp(lse_n - lse) * out_n

An LSE of -inf (no keys), +inf or NaN marks an empty state whose ``out`` is
ignored; if every state is empty the result is ``(0, -inf)``. This is the same
contract as ``medha_kernels.merge_states``; here the state axis comes first
and everything is computed in fp32 (fp64 for fp64 input).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each state's share of the merged output, and the merged LSE.

    Args:
        lses: ``[num_states, num_tokens, num_heads]``, natural-log LSEs.

    Returns:
        ``(w, lse)``: ``w`` is ``[num_states, num_tokens, num_heads]`` with
        ``w[n] = exp(lses[n] - lse)`` (0 for an empty state, and 0 everywhere
        in a row where every state is empty), and ``lse`` is
        ``[num_tokens, num_heads]``; both fp32 (fp64 for fp64 input).
    """
    s = lses.to(torch.promote_types(lses.dtype, torch.float32))
    s = torch.where(torch.isnan(s) | (s == float("inf")), NEG_INF, s)
    if s.shape[0] == 0:
        return s, s.new_full(s.shape[1:], NEG_INF)
    m = s.amax(dim=0)  # -inf only where every state is empty
    m = torch.where(torch.isinf(m), 0.0, m)
    e = torch.exp(s - m)  # exp(-inf) = 0 for empty states
    total = e.sum(dim=0)
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, 1.0)
    w = e / safe_total
    lse = torch.where(nonempty, m + torch.log(safe_total), NEG_INF)
    return w, lse


def weighted_output(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * out`` in ``w``'s dtype, with ``out`` ignored (not NaN) where ``w == 0``.

    Args:
        out: ``[..., num_tokens, num_heads, head_dim]``.
        w: ``[..., num_tokens, num_heads]``.
    """
    w = w.unsqueeze(-1)
    return torch.where(w > 0, out.to(w.dtype), 0.0) * w


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` partial attention states (the reference merge).

    Args:
        outs: ``[num_states, num_tokens, num_heads, head_dim]``, fp16, bf16,
            fp32 or fp64.
        lses: ``[num_states, num_tokens, num_heads]``, natural-log LSEs.

    Returns:
        ``(out, lse)``: ``[num_tokens, num_heads, head_dim]`` in ``outs``'s
        dtype and ``[num_tokens, num_heads]`` fp32 (fp64 for fp64 input).

    >>> import torch
    >>> outs = torch.stack([torch.ones(1, 1, 2), torch.zeros(1, 1, 2)])
    >>> out, lse = merge_partials(outs, torch.zeros(2, 1, 1))
    >>> out[0, 0].tolist(), round(lse.item(), 4)
    ([0.5, 0.5], 0.6931)
    """
    if outs.dim() != 4 or lses.shape != outs.shape[:3]:
        raise ValueError(
            "expected outs [num_states, num_tokens, num_heads, head_dim] and lses "
            f"[num_states, num_tokens, num_heads], got {tuple(outs.shape)} and "
            f"{tuple(lses.shape)}"
        )
    w, lse = merge_weights(lses)
    return weighted_output(outs, w).sum(dim=0).to(outs.dtype), lse
