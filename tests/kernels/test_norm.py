"""``medha_kernels.rms_norm``: the native fp32 CPU kernel against transformers, bit for bit.

transformers' ``LlamaRMSNorm`` is the truth (the model must match it exactly):
odd hidden sizes on purpose (not multiples of the 8- or 16-lane vectors torch's
sum uses), one to many rows, tiny to huge values, with and without the
residual add (vLLM's ``fused_add_rms_norm``: ``h = x + residual`` first).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from medha_kernels import native, rms_norm
from medha_kernels.norm import native_rms_norm_available

transformers = pytest.importorskip("transformers")
norm_module = importlib.import_module("medha_kernels.norm")

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="needs a C++ compiler and ninja"
)

HIDDEN = [1, 7, 8, 15, 16, 17, 33, 64, 100, 576, 1000, 2048, 4099]
ROWS = [1, 2, 5, 17, 130]


def _hf(hidden: int, weight: torch.Tensor, eps: float):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(weight)
    return hf


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("scale", [1e-4, 1.0, 300.0, 1e4])
def test_native_matches_transformers_bit_for_bit(hidden: int, rows: int, scale: float) -> None:
    g = torch.Generator().manual_seed(hidden * 1000 + rows)
    eps = 1e-5 if hidden % 2 else 1e-6
    weight = torch.randn(hidden, generator=g) * 0.2 + 1
    x = torch.randn(rows, hidden, generator=g) * scale
    r = torch.randn(rows, hidden, generator=g) * scale
    hf = _hf(hidden, weight, eps)
    module = native.get_module("cpu")
    with torch.no_grad():
        h, got = module.rms_norm(x, weight, eps, None)
        assert h is x or torch.equal(h, x)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(got, hf(x))
        h, got = module.rms_norm(x, weight, eps, r)
        assert torch.equal(h, x + r)
        assert torch.equal(got, hf(x + r))
    # and the previous model path (F.rms_norm with the weight) agrees with both
    assert torch.equal(got, torch.nn.functional.rms_norm(x + r, (hidden,), weight, eps))


def test_wrapper_takes_the_native_path_and_falls_back() -> None:
    assert native_rms_norm_available()  # this machine builds the extension
    hidden = 96
    weight = torch.randn(hidden) * 0.2 + 1
    x, r = torch.randn(3, hidden), torch.randn(3, hidden)
    hf = _hf(hidden, weight, 1e-5)
    calls = []
    real = norm_module._module()

    class Spy:
        def rms_norm(self, *args):
            calls.append(args[0].shape)
            return real.rms_norm(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norm_module, "_module", lambda: Spy())
        with torch.no_grad():
            h, y = rms_norm(x, weight, 1e-5)
            assert h is x and torch.equal(y, hf(x))
            h, y = rms_norm(x, weight, 1e-5, r)
            assert torch.equal(h, x + r) and torch.equal(y, hf(x + r))
        assert calls == [(3, hidden), (3, hidden)]
        # a strided input, a 3-D input, 16-bit dtypes, autograd: torch, the same bits
        xs = torch.randn(3, 2 * hidden)[:, ::2]
        with torch.no_grad():
            assert torch.equal(rms_norm(xs, weight, 1e-5)[1], hf(xs))
            x3 = torch.randn(2, 3, hidden)
            assert torch.equal(rms_norm(x3, weight, 1e-5)[1], hf(x3))
            for dtype in (torch.bfloat16, torch.float16):
                hf16 = _hf(hidden, weight, 1e-5).to(dtype)
                xd, rd = x.to(dtype), r.to(dtype)
                h, y = rms_norm(xd, weight.to(dtype), 1e-5, rd)
                assert y.dtype == dtype and torch.equal(h, xd + rd)
                assert torch.equal(y, hf16(xd + rd))
        wg = weight.clone().requires_grad_(True)
        rms_norm(x, wg, 1e-5)[1].sum().backward()
        assert wg.grad is not None
        assert calls == [(3, hidden), (3, hidden)]  # none of those went native
    with pytest.raises(RuntimeError, match="expected x \\[M, K\\] and weight \\[K\\]"):
        real.rms_norm(x, torch.ones(hidden + 1), 1e-5, None)
    with pytest.raises(RuntimeError, match="residual must be a contiguous fp32"):
        real.rms_norm(x, weight, 1e-5, torch.randn(2, hidden))
