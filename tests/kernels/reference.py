"""Independent references for kernel tests (flash-attention's tolerance rule).

The truth is a dense float64 computation. The baseline is the same naive
computation done by plain torch in the input's precision. A kernel passes if
its error against the truth is at most twice the baseline's (plus a tiny floor
for cases where the baseline happens to be exact).
"""

from __future__ import annotations

import torch

from tests.numerics import assert_twice_torch as assert_twice_torch
from tests.numerics import max_err as max_err

NEG_INF = float("-inf")


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_offset: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention. ``upcast``: float64 truth; else plain torch in q's dtype."""
    dtype = torch.float64 if upcast else q.dtype
    num_q, hq, d = q.shape
    group = hq // k.shape[1]
    offset = k.shape[0] - num_q if q_offset is None else q_offset
    scale = d**-0.5 if sm_scale is None else sm_scale
    kk = k.to(dtype).repeat_interleave(group, dim=1)
    vv = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), kk) * scale
    if causal:
        allowed = torch.arange(k.shape[0]).view(1, -1) <= (torch.arange(num_q) + offset).view(-1, 1)
        scores = scores.masked_fill(~allowed.to(q.device).unsqueeze(0), NEG_INF)
    lse = torch.logsumexp(scores.double() if upcast else scores.float(), dim=-1)
    empty = torch.isinf(lse)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", p, vv)
    o = torch.where(empty.transpose(0, 1).unsqueeze(-1), 0, o)
    return o, lse.transpose(0, 1)


def merge_ref(
    v: torch.Tensor, s: torch.Tensor, *, upcast: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``[T, N, H, D]`` / ``[T, N, H]`` states; +inf/NaN LSE count as empty."""
    vd = torch.float64 if upcast else v.dtype
    sd = torch.float64 if upcast else torch.float32
    s = s.to(sd)
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, NEG_INF))
    m = s.amax(dim=1, keepdim=True)
    m = torch.where(torch.isinf(m), 0, m)
    w = torch.exp(s - m)
    total = w.sum(dim=1)
    vv = torch.where(w.unsqueeze(-1) > 0, v.to(vd), 0)
    o = (vv * w.unsqueeze(-1).to(vd)).sum(dim=1) / torch.where(total > 0, total, 1).unsqueeze(
        -1
    ).to(vd)
    lse = torch.where(
        total > 0, m.squeeze(1) + torch.log(torch.where(total > 0, total, 1)), NEG_INF
    )
    return o, lse


def paged_to_dense(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Gather a sequence's first ``length`` tokens from ``[num_blocks, block, H, D]``."""
    blocks = table_row[: -(-length // cache.shape[1])].long()
    return cache[blocks].flatten(0, 1)[:length]
