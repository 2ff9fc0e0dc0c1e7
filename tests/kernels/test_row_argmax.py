"""``medha_kernels.row_argmax`` against torch's ``max(dim=-1).indices``: ties, inf, NaN."""

from __future__ import annotations

import pytest
import torch

from medha_kernels import row_argmax
from medha_kernels.argmax import native_row_argmax_available


def _reference(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=-1).indices


def test_the_native_kernel_is_built_here() -> None:
    # every CI machine has a compiler: the fp32 CPU path must be the native one
    assert native_row_argmax_available()


@pytest.mark.parametrize("rows", [1, 3, 32, 33])
@pytest.mark.parametrize("vocab", [1, 2, 15, 16, 17, 31, 48, 1000, 49152])
def test_random_rows_give_torchs_indices(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100_003 + vocab)
    x = torch.randn(rows, vocab, generator=gen)
    assert torch.equal(row_argmax(x), _reference(x))


@pytest.mark.parametrize("vocab", [16, 17, 40, 49152])
def test_ties_take_the_first_maximal_index(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen)
    peak = float(x.max()) + 1.0
    # row 0: the same maximum in two lanes of later vectors; row 1: in the tail and a lane;
    # row 2: at the very end and the very start; row 3: a whole row equal; row 4: one
    # lane reaching the maximum twice; row 5: -0.0 and 0.0 as the maximum (equal)
    cols = {
        0: [min(vocab - 1, 37), min(vocab - 1, 21)],
        1: [vocab - 1, vocab // 2],
        2: [vocab - 1, 0],
        4: [min(vocab - 1, 33), 1],
    }
    for row, at in cols.items():
        x[row, at] = peak
    x[3] = peak
    x[5] = -1.0
    x[5, min(vocab - 1, 20)] = -0.0
    x[5, vocab - 1] = 0.0
    want = _reference(x)
    assert torch.equal(row_argmax(x), want)
    assert want[2] == 0 and want[3] == 0


def test_infinite_rows() -> None:
    x = torch.full((3, 100), float("-inf"))
    x[1, 50] = float("inf")
    x[2, 70] = float("inf")
    x[2, 90] = float("inf")
    got = row_argmax(x)
    assert torch.equal(got, _reference(x))
    assert got.tolist() == [0, 50, 70]


@pytest.mark.parametrize("at", [0, 5, 16, 40, 99])
def test_a_row_with_a_nan_gives_torchs_answer(at: int) -> None:
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(at))
    x[2, at] = float("nan")
    assert torch.equal(row_argmax(x), _reference(x))


def test_other_inputs_go_to_torch() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, generator=gen)
    strided = x[:, ::2]  # not contiguous
    assert torch.equal(row_argmax(strided), _reference(strided))
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        y = x.to(dtype)
        assert torch.equal(row_argmax(y), _reference(y))
    empty_rows = torch.empty(0, 64)
    assert row_argmax(empty_rows).shape == (0,)
    out = row_argmax(x)
    assert out.dtype == torch.int64 and out.shape == (8,)


def test_the_switch_turns_the_native_path_off(monkeypatch) -> None:
    from medha_kernels import argmax

    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv("MEDHA_NATIVE_ARGMAX", "0")
    argmax._module.cache_clear()
    try:
        assert not argmax.native_row_argmax_available()
        assert torch.equal(row_argmax(x), _reference(x))
    finally:
        monkeypatch.delenv("MEDHA_NATIVE_ARGMAX")
        argmax._module.cache_clear()
    assert argmax.native_row_argmax_available()
