"""The project's tolerance rule for numerics (flash-attention's rule).

The truth is a float64 computation. The baseline is the plain path in the
precision under test (plain torch, one process, transformers' own model). A
result passes if its error against the truth is at most twice the baseline's,
plus a tiny floor for cases where the baseline happens to be exact. No fixed
tolerance depends on random weights this way: a checkpoint whose logits are
larger, or whose baseline is less exact, moves both errors together.
"""

from __future__ import annotations

import torch


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over entries where ``ref`` is finite; inf must match."""
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isinf(a.double()) & ~finite, ~finite), "non-finite entries differ"
    if not finite.any():
        return 0.0
    return (a.double()[finite] - ref.double()[finite]).abs().max().item()


def assert_twice_torch(
    out: torch.Tensor, truth: torch.Tensor, baseline: torch.Tensor, *, what: str = "output"
) -> None:
    """``out``'s error vs ``truth`` is at most twice ``baseline``'s (plus a tiny floor).

    Args:
        out: the result under test, any float dtype, the shape of ``truth``.
        truth: the float64 reference.
        baseline: the plain path's result in ``out``'s precision, the shape of ``truth``.
        what: names the quantity in the failure message.
    """
    assert out.shape == truth.shape == baseline.shape, (out.shape, truth.shape, baseline.shape)
    assert not torch.isnan(out).any(), f"{what}: NaN in result"
    err, err_pt = max_err(out, truth), max_err(baseline, truth)
    scale = truth[torch.isfinite(truth)].abs().max().item() if torch.isfinite(truth).any() else 1.0
    floor = 4 * torch.finfo(torch.float32).eps * max(1.0, scale)
    assert err <= 2 * err_pt + floor, (
        f"{what}: error {err:.3e} > 2 x the baseline's {err_pt:.3e} (+{floor:.1e})"
    )
