"""``medha_kernels.linear.linear_add_rms_norm``: a projection, the residual add, an RMSNorm;
``linear_add_rms_norm_swiglu``: those, then a SwiGLU MLP (gate/up, silu, down).

A decode layer's o-projection and post-attention norm in one native call (fp32 CPU,
at most ``native_row_limit`` rows): against a float64 truth it must stay within twice
plain torch's fp32 error (``F.linear``, ``+ residual``, ``F.rms_norm``), for odd
shapes (K and N not multiples of the 8- or 16-lane vectors) and 1 to 64 rows; and it
must give exactly the bits of the two calls it replaces (``linear``, then ``rms_norm``
with the residual), so the model's tokens cannot change. Other dtypes, non-contiguous
tensors, autograd or too many rows fall back to those two calls. The SwiGLU variant
likewise gives exactly the bits of ``linear_add_rms_norm``, ``linear_silu_mul`` and
``linear``, and is within twice plain torch's error of a float64 MLP.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from medha_kernels import native, rms_norm
from medha_kernels.linear import (
    linear,
    linear_add_rms_norm,
    linear_add_rms_norm_swiglu,
    linear_silu_mul,
)

from .reference import assert_twice_torch

linear_module = importlib.import_module("medha_kernels.linear")

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="needs a C++ compiler and ninja"
)

EPS = 1e-5


def _inputs(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    r = torch.randn(m, n, generator=g)
    nw = torch.randn(n, generator=g) * 0.2 + 1
    return x, w, r, nw


def _truth(x, w, r, nw):
    h = x.double() @ w.double().T + r.double()
    return h, nw.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS))


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 48, 63, 64])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (1, 7), (13, 100), (33, 1537), (100, 17)])
def test_matches_float64_and_the_two_calls(m: int, n: int, k: int) -> None:
    x, w, r, nw = _inputs(m, n, k, seed=m * 10000 + n * 10 + k)
    h, out = linear_add_rms_norm(x, w, r, nw, EPS)
    assert h.dtype == out.dtype == torch.float32
    assert h.shape == out.shape == (m, n)
    h_truth, truth = _truth(x, w, r, nw)
    h_plain = F.linear(x, w) + r
    plain = F.rms_norm(h_plain, (n,), nw, EPS)
    assert_twice_torch(h, h_truth, h_plain, what=f"h m={m} n={n} k={k}")
    assert_twice_torch(out, truth, plain, what=f"norm m={m} n={n} k={k}")
    # exactly the bits of the calls it replaces
    h2, out2 = rms_norm(linear(x, w), nw, EPS, r)
    assert torch.equal(h, h2) and torch.equal(out, out2)


def test_native_call_and_what_it_declines() -> None:
    module = native.get_module("cpu")
    limit = linear_module.native_row_limit()
    assert limit > 0  # this machine builds the vectorized kernel (as test_linear asserts)
    x, w, r, nw = _inputs(5, 24, 40, seed=1)
    h, out = module.linear_add_rms_norm(x, w, r, nw, EPS, limit)
    h2, out2 = rms_norm(linear(x, w), nw, EPS, r)
    assert torch.equal(h, h2) and torch.equal(out, out2)
    # non-contiguous x and residual are made contiguous: the same bits
    h, out = module.linear_add_rms_norm(x.T.contiguous().T, w, r.T.contiguous().T, nw, EPS, 5)
    assert torch.equal(h, h2) and torch.equal(out, out2)
    # None (the caller's torch path) for what the kernels do not take
    declined = {
        "rows over max_rows": (x, w, r, nw, EPS, 4),
        "residual shape": (x, w, r[:, :-1].contiguous(), nw, EPS, limit),
        "norm weight shape": (x, w, r, nw[:-1], EPS, limit),
        "K mismatch": (x[:, :-1].contiguous(), w, r, nw, EPS, limit),
        "fp64": (x.double(), w, r, nw, EPS, limit),
        "bf16 residual": (x, w, r.bfloat16(), nw, EPS, limit),
        "non-contiguous weight": (x, w.T.contiguous().T, r, nw, EPS, limit),
        "3-D x": (x.unsqueeze(0), w, r, nw, EPS, limit),
        "no rows": (x[:0], w, r[:0], nw, EPS, limit),
    }
    for what, args in declined.items():
        assert module.linear_add_rms_norm(*args) is None, what
    wg = w.clone().requires_grad_(True)
    assert module.linear_add_rms_norm(x, wg, r, nw, EPS, limit) is None
    with torch.no_grad():
        assert module.linear_add_rms_norm(x, wg, r, nw, EPS, limit) is not None


def test_fallbacks_give_the_two_calls() -> None:
    n, k = 19, 45
    limit = linear_module.native_row_limit()
    x, w, r, nw = _inputs(limit + 3, n, k, seed=2)  # more rows than the native limit
    h, out = linear_add_rms_norm(x, w, r, nw, EPS)
    assert torch.equal(h, F.linear(x, w) + r)
    assert torch.equal(out, rms_norm(F.linear(x, w), nw, EPS, r)[1])
    x, w, r, nw = _inputs(4, n, k, seed=3)
    # a non-contiguous x is made contiguous; a non-contiguous residual takes the two calls
    xt = x.T.contiguous().T
    assert torch.equal(
        linear_add_rms_norm(xt, w, r, nw, EPS)[1], rms_norm(linear(x, w), nw, EPS, r)[1]
    )
    rt = r.T.contiguous().T
    h, out = linear_add_rms_norm(x, w, rt, nw, EPS)
    assert torch.equal(out, rms_norm(linear(x, w), nw, EPS, r)[1])
    # bf16: torch's ops in bf16
    xb, wb, rb, nwb = (t.bfloat16() for t in (x, w, r, nw))
    h, out = linear_add_rms_norm(xb, wb, rb, nwb, EPS)
    assert h.dtype == torch.bfloat16 and torch.equal(h, F.linear(xb, wb) + rb)
    assert torch.equal(out, rms_norm(F.linear(xb, wb), nwb, EPS, rb)[1])
    # autograd: torch's ops, gradients flow
    wg = w.clone().requires_grad_(True)
    h, out = linear_add_rms_norm(x, wg, r, nw, EPS)
    out.sum().backward()
    assert wg.grad is not None and wg.grad.shape == w.shape


def _mlp_inputs(m: int, n: int, k: int, i: int, seed: int):
    x, w, r, nw = _inputs(m, n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    gate_up = torch.randn(2 * i, n, generator=g) / n**0.5
    down = torch.randn(n, i, generator=g) / i**0.5
    return x, w, r, nw, gate_up, down


@pytest.mark.parametrize("m", [1, 5, 9, 16, 17, 24, 32, 33, 64])
@pytest.mark.parametrize(("n", "k", "i"), [(64, 64, 128), (576, 576, 1536), (13, 33, 7)])
def test_swiglu_matches_float64_and_the_calls(m: int, n: int, k: int, i: int) -> None:
    x, w, r, nw, gate_up, down = _mlp_inputs(m, n, k, i, seed=m * 1000 + n + k + i)
    h, out = linear_add_rms_norm_swiglu(x, w, r, nw, EPS, gate_up, down)
    assert h.shape == out.shape == (m, n) and out.dtype == torch.float32
    # exactly the calls it replaces
    h2, normed = rms_norm(linear(x, w), nw, EPS, r)
    want = linear(linear_silu_mul(normed, gate_up), down)
    assert torch.equal(h, h2) and torch.equal(out, want)
    # and within twice plain torch's fp32 error of a float64 truth
    _, truth_n = _truth(x, w, r, nw)
    gd, ud = gate_up.double().chunk(2)
    truth = (F.silu(truth_n @ gd.T) * (truth_n @ ud.T)) @ down.double().T
    plain_n = F.rms_norm(F.linear(x, w) + r, (n,), nw, EPS)
    g, u = gate_up.chunk(2)
    plain = F.linear(F.silu(F.linear(plain_n, g)) * F.linear(plain_n, u), down)
    assert_twice_torch(out, truth, plain, what=f"swiglu m={m} n={n} k={k} i={i}")


def test_swiglu_declines_and_falls_back() -> None:
    module = native.get_module("cpu")
    limit = linear_module.native_row_limit()
    x, w, r, nw, gate_up, down = _mlp_inputs(3, 20, 30, 11, seed=5)
    h2, normed = rms_norm(linear(x, w), nw, EPS, r)
    want = linear(linear_silu_mul(normed, gate_up), down)
    if limit:
        got = module.linear_add_rms_norm_swiglu(x, w, r, nw, EPS, gate_up, down, limit)
        assert torch.equal(got[0], h2) and torch.equal(got[1], want)
        for what, gu, dn in (
            ("odd gate_up rows", gate_up[:-1].contiguous(), down),
            ("down shape", gate_up, down[:, :-1].contiguous()),
            ("non-contiguous down", gate_up, down.T.contiguous().T),
            ("bf16 gate_up", gate_up.bfloat16(), down),
        ):
            assert module.linear_add_rms_norm_swiglu(x, w, r, nw, EPS, gu, dn, limit) is None, what
        dg = down.clone().requires_grad_(True)
        assert module.linear_add_rms_norm_swiglu(x, w, r, nw, EPS, gate_up, dg, limit) is None
    # a non-contiguous down: the separate calls (torch's linear), the same values
    h, out = linear_add_rms_norm_swiglu(x, w, r, nw, EPS, gate_up, down.T.contiguous().T)
    assert torch.equal(h, h2)
    torch.testing.assert_close(out, want)
    # bf16 end to end: torch's ops
    xb, wb, rb, nwb, gub, db = (t.bfloat16() for t in (x, w, r, nw, gate_up, down))
    h, out = linear_add_rms_norm_swiglu(xb, wb, rb, nwb, EPS, gub, db)
    hb, nb = rms_norm(F.linear(xb, wb), nwb, EPS, rb)
    assert out.dtype == torch.bfloat16 and torch.equal(h, hb)
    assert torch.equal(out, linear(linear_silu_mul(nb, gub), db))
