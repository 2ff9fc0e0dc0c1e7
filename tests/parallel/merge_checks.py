"""Checks shared by the KVP merger tests."""

from __future__ import annotations

import torch

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
