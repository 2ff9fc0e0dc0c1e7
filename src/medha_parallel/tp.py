"""Tensor-parallel collectives: sum in fp32, hand back the input's dtype.

Every op is out of place and forward only (inputs are detached): the input is
never modified and gradients do not flow through the collective. With a TP
degree of 1 every op is a no-op that returns its input. Failures and timeouts
(the group's timeout, set by ``ParallelState.initialize(timeout_s=...)``)
raise :class:`~medha_parallel.errors.CommunicationError` naming ``tp`` and the op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from medha_parallel.compat import all_gather_concat
from medha_parallel.errors import named_comm
from medha_parallel.state import ParallelState


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 inputs; fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


class TPCommunicator:
    """All-reduce, all-gather and reduce-scatter over one TP group.

    Build it from a :class:`ParallelState` (its TP group), from a process
    group (``TPCommunicator(group=pg)``), or with no argument for a single
    process (TP degree 1, every op a no-op, no ``torch.distributed`` needed).

    Attributes:
        world_size: the TP degree.
        rank: this rank's index inside the TP group (which shard it holds).
    """

    def __init__(
        self, state: ParallelState | None = None, *, group: dist.ProcessGroup | None = None
    ) -> None:
        if state is not None and group is not None:
            raise ValueError("pass a ParallelState or a process group, not both")
        if state is not None:
            self.group = state.tp_group
            self.world_size = state.layout.tp
            self.rank = state.coords.tp
        elif group is not None:
            self.group = group
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.group, self.world_size, self.rank = None, 1, 0

    def __repr__(self) -> str:
        return f"TPCommunicator(rank={self.rank}, world_size={self.world_size})"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group.

        Args:
            x: any shape, floating point; the same shape on every rank.

        Returns:
            The sum, accumulated in fp32 (fp64 for fp64), in ``x``'s dtype.
        """
        if self.world_size == 1:
            return x
        buf = x.detach().to(accumulation_dtype(x.dtype), copy=True).contiguous()
        with named_comm("tp", "all_reduce"):
            dist.all_reduce(buf, group=self.group)
        return buf.to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in TP-rank order.

        Args:
            x: any shape; the same shape and dtype on every rank.
            dim: the tensor dimension to concatenate along.

        Returns:
            ``x``'s shape with ``dim`` multiplied by the TP degree, ``x``'s dtype.
        """
        if self.world_size == 1:
            return x
        dim = _normalize_dim(dim, x.dim())
        src = x.detach().contiguous()
        # gloo accepts only a dim-0 concatenated output: gather there, then move.
        out = src.new_empty((self.world_size * src.shape[0], *src.shape[1:]))
        with named_comm("tp", "all_gather"):
            all_gather_concat(out, src, self.group)
        if dim == 0:
            return out
        return torch.cat(out.chunk(self.world_size, dim=0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum ``x`` over the group and keep this rank's slice along ``dim``.

        Args:
            x: any shape with ``x.shape[dim]`` divisible by the TP degree; the
                same shape on every rank.
            dim: the tensor dimension to split.

        Returns:
            Slice ``rank`` of the sum (``x.shape[dim] // world_size`` wide),
            accumulated in fp32, in ``x``'s dtype.
        """
        if self.world_size == 1:
            return x
        dim = _normalize_dim(dim, x.dim())
        if x.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible "
                f"by the TP degree {self.world_size}"
            )
        src = x.detach().movedim(dim, 0).to(accumulation_dtype(x.dtype)).contiguous()
        out = src.new_empty((src.shape[0] // self.world_size, *src.shape[1:]))
        with named_comm("tp", "reduce_scatter"):
            dist.reduce_scatter_tensor(out, src, group=self.group)
        return out.movedim(0, dim).to(x.dtype).contiguous()


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a {ndim}-D tensor")
    return dim % ndim
