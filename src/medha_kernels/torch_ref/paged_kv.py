"""Writing new K/V into a paged cache, in plain torch."""

from __future__ import annotations

import torch


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """See :func:`medha_kernels.append_paged_kv` (arguments already checked)."""
    keep = slots >= 0
    idx = slots[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, idx, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v[keep].to(v_cache.dtype))
