"""Checks shared by the KVP merger tests."""

from __future__ import annotations

import torch

from medha_parallel import ParallelLayout, ParallelState
from medha_parallel.kvp import KVPCommunicator
from medha_parallel.merge import merge_partials
from tests.numerics import assert_twice_torch


def assert_merged_like_merge(got: list) -> None:
    """Each ``((out, lse), (checked_out, checked_lse), outs, lses)`` of one rank: the merged
    state equals the checked merge bit for bit and is within twice plain torch's fp32
    error of the float64 merge of the states ``outs`` ``[T, N, H, D]`` / ``lses``
    ``[T, N, H]``."""
    for (out, lse), (c_out, c_lse), outs, lses in got:
        assert torch.equal(out, c_out) and torch.equal(lse, c_lse)
        truth_out, truth_lse = merge_partials(outs.double(), lses.double())
        base_out, base_lse = merge_partials(outs, lses)
        assert_twice_torch(out, truth_out, base_out, what="merged output")
        assert_twice_torch(lse, truth_lse, base_lse, what="merged LSE")


def decode_states(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ranks' decode states, seeded: outputs ``[2, 1, 4, 16]`` and LSEs ``[2, 1, 4]``
    (rank first), fp32."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 4, 16, generator=gen), 3 * torch.randn(2, 1, 4, generator=gen)


def shm_kvp(rank: int, world: int, init: str) -> KVPCommunicator:
    """This rank's KVP communicator over the shared-memory exchange (``world`` groups,
    CPU)."""
    state = ParallelState.initialize(
        ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
    )
    return KVPCommunicator(state, shared_memory=True)
