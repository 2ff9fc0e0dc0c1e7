"""``medha_kernels.linear``: the native small-M CPU path against a float64 truth.

Odd sizes on purpose: K not a multiple of the 8-lane vectors, N not a
multiple of the 3-row tasks, M not a multiple of the 4-row blocks; with and
without bias; the error is at most twice ``F.linear``'s in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medha_kernels import linear, native
from medha_kernels.linear import SMALL_M_MAX, native_linear_available

from .reference import assert_twice_torch

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="needs a C++ compiler and ninja"
)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, SMALL_M_MAX])
@pytest.mark.parametrize(("n", "k"), [(1, 7), (4, 8), (13, 577), (50, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_matches_float64(m: int, n: int, k: int, with_bias: bool) -> None:
    x = torch.randn(m, k)
    w = torch.randn(n, k) / k**0.5
    b = torch.randn(n) if with_bias else None
    out = linear(x, w, b)
    truth = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_twice_torch(out, truth, F.linear(x, w, b), what=f"linear m={m} n={n} k={k}")


def test_native_path_is_taken_and_others_fall_back() -> None:
    assert native_linear_available()  # this machine builds the AVX2 kernel
    x, w = torch.randn(4, 33), torch.randn(7, 33)
    module = native.get_module("cpu")
    torch.testing.assert_close(module.linear_small_m(x, w, None), linear(x, w), rtol=0, atol=0)
    # more rows, other dtypes, a 3-D input, autograd: plain F.linear
    big = torch.randn(SMALL_M_MAX + 1, 33)
    assert torch.equal(linear(big, w), F.linear(big, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))
    x3 = torch.randn(2, 3, 33)
    assert torch.equal(linear(x3, w), F.linear(x3, w))
    wg = w.clone().requires_grad_(True)
    linear(x, wg).sum().backward()
    assert wg.grad is not None
    with pytest.raises(RuntimeError, match="expected x \\[M, K\\] and w \\[N, K\\]"):
        module.linear_small_m(x, torch.randn(7, 32), None)
