"""``medha_kernels.linear.linear_silu_mul``: SwiGLU over a fused gate/up weight.

From 17 to 32 rows on AVX-512 builds the native kernel applies ``silu(gate) *
up`` to the product's sums (its own ``exp``); it must stay within twice the
error of plain torch's fp32 ``F.silu(x @ gate^T) * (x @ up^T)`` against a
float64 truth. I (the gate's rows) not a multiple of the 14-row blocks, K not
a multiple of the 128-step slices or 16-lane vectors, M on both sides of the
fused range. At other row counts the result is exactly ``linear`` then torch's
``silu`` and ``mul``; with a bias, autograd, other dtypes or too many rows,
exactly torch's.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from medha_kernels import native
from medha_kernels.linear import linear, linear_silu_mul

from .reference import assert_twice_torch

linear_module = importlib.import_module("medha_kernels.linear")

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="needs a C++ compiler and ninja"
)


def _fused_here() -> bool:
    return native.get_module("cpu").linear_small_m_isa == "avx512"


def _truth_and_torch(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    i = w.shape[0] // 2
    xd, wd = x.double(), w.double()
    truth = F.silu(xd @ wd[:i].T) * (xd @ wd[i:].T)
    plain = F.silu(F.linear(x, w[:i])) * F.linear(x, w[i:])
    return truth, plain


@pytest.mark.parametrize("m", [1, 8, 16, 17, 20, 24, 31, 32, 33, 64])
@pytest.mark.parametrize(("i", "k"), [(1536, 576), (1, 7), (13, 100), (14, 128), (29, 1537)])
def test_matches_float64(m: int, i: int, k: int) -> None:
    x = torch.randn(m, k)
    w = torch.randn(2 * i, k) / k**0.5
    out = linear_silu_mul(x, w)
    truth, plain = _truth_and_torch(x, w)
    assert out.dtype == torch.float32 and out.shape == (m, i)
    assert_twice_torch(out, truth, plain, what=f"linear_silu_mul m={m} i={i} k={k}")


@pytest.mark.parametrize("m", [17, 32])
def test_wide_gate_values(m: int) -> None:
    # gate sums from about -300 to 300: exp's clamps at both ends, silu ~ 0 and ~ identity
    k, i = 64, 45
    x = torch.randn(m, k)
    w = torch.randn(2 * i, k) * torch.linspace(0.01, 40.0, 2 * i).unsqueeze(1)
    out = linear_silu_mul(x, w)
    truth, plain = _truth_and_torch(x, w)
    assert torch.isfinite(out).all()
    assert_twice_torch(out, truth, plain, what=f"linear_silu_mul wide m={m}")


def test_fused_range_and_fallbacks() -> None:
    k, i = 40, 23
    w = torch.randn(2 * i, k)
    limit = linear_module.native_row_limit()
    for m in (1, 9, 16, 33, limit):  # outside 17..32: linear, then torch's silu and mul
        x = torch.randn(m, k)
        gate, up = linear(x, w).chunk(2, dim=-1)
        assert torch.equal(linear_silu_mul(x, w), F.silu(gate) * up), m
    x = torch.randn(24, k)
    gate, up = linear(x, w).chunk(2, dim=-1)
    same = torch.equal(linear_silu_mul(x, w), F.silu(gate) * up)
    assert same != _fused_here()  # fused: its own exp, not bit for bit torch's silu
    # a bias, more rows than the limit, bf16, autograd: torch end to end
    b = torch.randn(2 * i)
    for x, ww, bb in (
        (torch.randn(24, k), w, b),
        (torch.randn(limit + 1, k), w, None),
        (torch.randn(24, k).bfloat16(), w.bfloat16(), None),
    ):
        gate, up = F.linear(x, ww, bb).chunk(2, dim=-1)
        assert torch.equal(linear_silu_mul(x, ww, bb), F.silu(gate) * up)
    wg = w.clone().requires_grad_(True)
    out = linear_silu_mul(torch.randn(24, k), wg)
    assert out.requires_grad
    out.sum().backward()
    assert wg.grad is not None and wg.grad.shape == w.shape


def test_strided_input_and_offset_weight() -> None:
    base = torch.randn(24, 300)
    x = base[:, 1:259:2]  # [24, 129], not contiguous
    w_full = torch.randn(70, 129) / 129**0.5
    w = w_full[3:63]  # [60, 129]: contiguous, offset storage
    out = linear_silu_mul(x, w)
    truth, plain = _truth_and_torch(x, w)
    assert_twice_torch(out, truth, plain, what="linear_silu_mul strided")


def test_native_checks() -> None:
    module = native.get_module("cpu")
    with pytest.raises(RuntimeError, match="2 I, K"):
        module.linear_silu_mul(torch.randn(20, 8), torch.randn(7, 8))
    with pytest.raises(RuntimeError, match="fp32 only"):
        module.linear_silu_mul(torch.randn(20, 8).double(), torch.randn(6, 8).double())


@pytest.mark.parametrize("m", [17, 24, 32])
def test_huge_negative_gates_give_torchs_silu(m: int) -> None:
    # gates far below exp's clamp: silu is ~0 as in torch (not g / (1 + e^88)), -inf NaN
    gates = torch.tensor([-1e30, -1e36, -1e38, -3e38, -100.0, -88.5, float("-inf"), 5.0])
    k = gates.numel()
    x = torch.eye(k).repeat(m // k + 1, 1)[:m].contiguous()  # row j picks gate j % k
    w = torch.cat([torch.diag(gates), torch.ones(k, k)])  # up = 1 for every row
    out = linear_silu_mul(x, w)
    want = F.silu(F.linear(x, w[:k])) * F.linear(x, w[k:])
    torch.testing.assert_close(out, want, equal_nan=True, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("m", [1, 8, 24, 40])
def test_no_inner_dimension_gives_zeros(m: int) -> None:
    x, w = torch.randn(m, 0), torch.randn(60, 0)
    assert torch.equal(linear(x, w), torch.zeros(m, 60))
    assert torch.equal(linear_silu_mul(x, w), torch.zeros(m, 30))
