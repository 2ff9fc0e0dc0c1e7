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
    for src, cache in ((k, k_cache), (v, v_cache)):
        rows = src[keep].to(cache.dtype)
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, idx, rows)
        else:  # a view into a larger cache (K and V interleaved, say): write through it
            bs = cache.shape[1]
            cache[idx // bs, idx % bs] = rows
