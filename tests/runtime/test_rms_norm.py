"""RMSNorm against transformers' LlamaRMSNorm: bit for bit in every model dtype."""

from __future__ import annotations

import pytest
import torch

from medha_runtime.model.llama import RMSNorm

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("scale", [1e-2, 1.0, 200.0])
def test_rms_norm_matches_transformers_bit_for_bit(
    dtype: torch.dtype, hidden: int, scale: float
) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    eps = 1e-5
    g = torch.Generator().manual_seed(hidden)
    weight = (torch.randn(hidden, generator=g) * 0.2 + 1).to(dtype)
    x = (torch.randn(37, hidden, generator=g) * scale).to(dtype)
    ours = RMSNorm(hidden, eps, dtype=dtype)
    hf = LlamaRMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
        got, want = ours(x), hf(x)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)
