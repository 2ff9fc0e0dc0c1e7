"""``medha_kernels.linear`` at prefill sizes: oneDNN's fp32 product against a float64 truth.

From :data:`ONEDNN_MIN_M` rows with at most :data:`ONEDNN_MAX_K` input features
(no bias, AVX-512 CPUs) :func:`linear` and :func:`linear_silu_mul` call
``torch.ops.mkldnn._linear_pointwise``; its error must stay within twice
``F.linear``'s in fp32. Odd sizes on purpose (M, N, K off every vector and block
edge), the K limit's both sides, and the paths that stay on ``F.linear``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from medha_kernels import linear
from medha_kernels.linear import ONEDNN_MAX_K, ONEDNN_MIN_M, linear_silu_mul

from .reference import assert_twice_torch

linear_module = importlib.import_module("medha_kernels.linear")

pytestmark = pytest.mark.skipif(
    not linear_module._onednn_enabled(), reason="oneDNN's linear is off here (no AVX-512?)"
)


@pytest.mark.parametrize("m", [ONEDNN_MIN_M, 129, 301, 2047])
@pytest.mark.parametrize(("n", "k"), [(1, 7), (53, 37), (960, 576), (577, 575), (31, ONEDNN_MAX_K)])
def test_matches_float64(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    out = linear(x, w)
    truth = F.linear(x.double(), w.double())
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_twice_torch(out, truth, F.linear(x, w), what=f"linear m={m} n={n} k={k}")
    # the call is oneDNN's (not F.linear's bits by accident)
    expected = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("m", "i", "k"), [(ONEDNN_MIN_M, 1536, 576), (333, 97, 129)])
def test_silu_mul_matches_float64(m: int, i: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + i + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(2 * i, k, generator=g) / k**0.5
    out = linear_silu_mul(x, w)
    y = F.linear(x.double(), w.double())
    truth = F.silu(y[:, :i]) * y[:, i:]
    y32 = F.linear(x, w)
    plain = F.silu(y32[:, :i]) * y32[:, i:]
    assert_twice_torch(out, truth, plain, what=f"linear_silu_mul m={m} i={i} k={k}")


def test_strided_input() -> None:
    base = torch.randn(300, 700)
    x = base[:, 5:650:2]  # [300, 323], strided
    w = torch.randn(70, 323) / 323**0.5
    out = linear(x, w)
    assert_twice_torch(out, F.linear(x.double(), w.double()), F.linear(x, w), what="strided")


def test_other_cases_stay_on_torch() -> None:
    w = torch.randn(40, 33)
    # fewer rows, more input features than the limit, a bias, a 3-D input, bf16: F.linear
    for x, ww, b in (
        (torch.randn(ONEDNN_MIN_M - 1, 33), w, None),
        (torch.randn(ONEDNN_MIN_M, ONEDNN_MAX_K + 1), torch.randn(9, ONEDNN_MAX_K + 1), None),
        (torch.randn(200, 33), w, torch.randn(40)),
        (torch.randn(2, 200, 33), w, None),
        (torch.randn(200, 33).bfloat16(), w.bfloat16(), None),
    ):
        assert torch.equal(linear(x, ww, b), F.linear(x, ww, b))
    x = torch.randn(200, ONEDNN_MAX_K + 1)
    wg = torch.randn(18, ONEDNN_MAX_K + 1)
    y = F.linear(x, wg)
    assert torch.equal(linear_silu_mul(x, wg), F.silu(y[:, :9]) * y[:, 9:])
    # autograd: F.linear (oneDNN's op has no backward)
    xg = torch.randn(200, 33, requires_grad=True)
    linear(xg, w).sum().backward()
    assert xg.grad is not None


def test_mismatched_shapes_get_torchs_error() -> None:
    # oneDNN's own message ("could not create a primitive descriptor") names nothing
    x = torch.randn(ONEDNN_MIN_M, 64)
    for call in (
        lambda: linear(x, torch.randn(32, 63)),
        lambda: linear_silu_mul(x, torch.randn(32, 63)),
    ):
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            call()


def test_env_turns_it_off() -> None:
    code = (
        "import torch, torch.nn.functional as F\n"
        "from medha_kernels import linear\n"
        "x, w = torch.randn(300, 64), torch.randn(50, 64)\n"
        "assert torch.equal(linear(x, w), F.linear(x, w))\n"
    )
    env = {**os.environ, "MEDHA_ONEDNN_LINEAR": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
