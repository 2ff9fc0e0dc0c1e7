"""Megatron-style tensor-parallel linear layers (forward only).

A column-parallel layer followed by a row-parallel one is an MLP with a single
all-reduce::

    x [num_tokens, hidden] --Column(hidden -> ffn)--> [num_tokens, ffn // tp]
      --act--> --Row(ffn -> hidden)--> all_reduce --> [num_tokens, hidden]

Weights follow ``nn.Linear``: ``weight`` is ``[out_features, in_features]``
and ``y = x @ weight.T + bias``. TP rank ``r`` of ``tp`` holds slice ``r`` of
the split dimension, which must divide evenly. Collectives are not
differentiable: use these layers for inference.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from medha_kernels import linear
from medha_parallel.tp import TPCommunicator


def _shard_size(name: str, size: int, tp: int) -> int:
    if size % tp:
        raise ValueError(f"{name}={size} is not divisible by the TP degree {tp}")
    return size // tp


def _uniform_(t: torch.Tensor, fan_in: int) -> None:
    """``nn.Linear``'s default init, using the full (unsharded) fan-in."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        t.uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split across TP ranks.

    Rank ``r`` holds rows ``[r * out_features // tp, (r + 1) * out_features // tp)``
    of the full ``[out_features, in_features]`` weight (and the same slice of
    the bias). Without a communicator it is an ordinary linear layer (tp = 1).

    Args:
        in_features: full input size.
        out_features: full output size, divisible by the TP degree.
        comm: the TP communicator (default: a single process).
        bias: whether to add a bias.
        gather_output: all-gather the output shards into ``[num_tokens, out_features]``.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        comm: TPCommunicator | None = None,
        bias: bool = True,
        gather_output: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm if comm is not None else TPCommunicator()
        self.in_features = in_features
        self.out_features = out_features
        self.out_per_rank = _shard_size("out_features", out_features, self.comm.world_size)
        self.gather_output = gather_output
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, **kw)) if bias else None
        _uniform_(self.weight, in_features)
        if self.bias is not None:
            _uniform_(self.bias, in_features)

    @classmethod
    def from_weights(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        comm: TPCommunicator | None = None,
        gather_output: bool = False,
    ) -> ColumnParallelLinear:
        """This rank's shard of full weights.

        Args:
            weight: ``[out_features, in_features]``, the unsharded weight.
            bias: ``[out_features]`` or None.
            comm: the TP communicator; its ``rank`` picks the slice.
            gather_output: see the class.
        """
        out_features, in_features = weight.shape
        layer = cls(
            in_features,
            out_features,
            comm=comm,
            bias=bias is not None,
            gather_output=gather_output,
            device=weight.device,
            dtype=weight.dtype,
        )
        rows = slice(
            layer.comm.rank * layer.out_per_rank, (layer.comm.rank + 1) * layer.out_per_rank
        )
        with torch.no_grad():
            layer.weight.copy_(weight[rows])
            if bias is not None:
                layer.bias.copy_(bias[rows])
        return layer

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, comm: TPCommunicator | None = None, gather_output: bool = False
    ) -> ColumnParallelLinear:
        """This rank's shard of a full ``nn.Linear``."""
        return cls.from_weights(linear.weight, linear.bias, comm=comm, gather_output=gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
            x: ``[num_tokens, in_features]``, the same on every TP rank.

        Returns:
            ``[num_tokens, out_features // tp]`` (this rank's features), or
            ``[num_tokens, out_features]`` with ``gather_output``.
        """
        y = linear(x, self.weight, self.bias)  # F.linear, native for decode batches on CPUs
        return self.comm.all_gather(y, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.comm.world_size}, rank={self.comm.rank}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across TP ranks.

    Rank ``r`` holds columns ``[r * in_features // tp, (r + 1) * in_features // tp)``
    of the full ``[out_features, in_features]`` weight and the whole bias. Each
    rank multiplies its input slice, the partial products are all-reduced in
    fp32, and the bias is added once, after the reduction.

    Args:
        in_features: full input size, divisible by the TP degree.
        out_features: full output size.
        comm: the TP communicator (default: a single process).
        bias: whether to add a bias.
        input_is_parallel: the input is already this rank's slice
            ``[num_tokens, in_features // tp]`` (the output of a
            :class:`ColumnParallelLinear` without ``gather_output``); if False
            the layer takes the full ``[num_tokens, in_features]`` and slices it.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        comm: TPCommunicator | None = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm if comm is not None else TPCommunicator()
        self.in_features = in_features
        self.out_features = out_features
        self.in_per_rank = _shard_size("in_features", in_features, self.comm.world_size)
        self.input_is_parallel = input_is_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        _uniform_(self.weight, in_features)
        if self.bias is not None:
            _uniform_(self.bias, in_features)

    @property
    def _cols(self) -> slice:
        return slice(self.comm.rank * self.in_per_rank, (self.comm.rank + 1) * self.in_per_rank)

    @classmethod
    def from_weights(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        comm: TPCommunicator | None = None,
        input_is_parallel: bool = True,
    ) -> RowParallelLinear:
        """This rank's shard of full weights.

        Args:
            weight: ``[out_features, in_features]``, the unsharded weight.
            bias: ``[out_features]`` or None (kept whole on every rank).
            comm: the TP communicator; its ``rank`` picks the slice.
            input_is_parallel: see the class.
        """
        out_features, in_features = weight.shape
        layer = cls(
            in_features,
            out_features,
            comm=comm,
            bias=bias is not None,
            input_is_parallel=input_is_parallel,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(weight[:, layer._cols])
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        comm: TPCommunicator | None = None,
        input_is_parallel: bool = True,
    ) -> RowParallelLinear:
        """This rank's shard of a full ``nn.Linear``."""
        return cls.from_weights(
            linear.weight, linear.bias, comm=comm, input_is_parallel=input_is_parallel
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
            x: ``[num_tokens, in_features // tp]`` (``input_is_parallel``) or
                ``[num_tokens, in_features]``.

        Returns:
            ``[num_tokens, out_features]``, the same on every TP rank.
        """
        if not self.input_is_parallel:
            x = x[..., self._cols]
        y = self.comm.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.comm.world_size}, rank={self.comm.rank}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )
