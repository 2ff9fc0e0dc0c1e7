"""Differences between torch versions, in one place."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_concat(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Gather ``x`` from every rank into ``out`` (dim-0 concatenation).

    Uses ``all_gather_single`` where torch has it (``all_gather_into_tensor``
    is deprecated from torch 2.13), the older name otherwise.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
