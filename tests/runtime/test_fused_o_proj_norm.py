"""A decode layer from its o-projection through the residual add, the post-attention norm
and the MLP in one native call (``linear_add_rms_norm_swiglu``) leaves the tiny model's
logits and greedy tokens exactly as the separate calls (``o_proj.forward``,
``RMSNorm.forward_add``, ``LlamaMLP.forward``) gave them.

In process: every layer takes the fused call (TP 1, no bias), and the logits of a prefill
and of decode steps of 1 and 5 rows equal, bit for bit, those with the layer's separate
calls. Across processes: greedy tokens of kvp=1 and kvp=2 engines (their workers take the
fused call) equal one process's tokens with the separate calls.
"""

from __future__ import annotations

import pytest
import torch

import medha_runtime.model.llama as llama
from medha_kernels import linear, native, rms_norm
from medha_kernels.linear import linear_silu_mul, native_row_limit
from medha_runtime.model import ForwardBatch
from medha_runtime.model.tiny import build_tiny, tiny_tokenizer
from tests.runtime.fused_tokens import PROMPTS, greedy_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _separate(x, weight, residual, norm_weight, eps, gate_up, down):
    """What the layer ran before: the projection, the add and the norm, then the MLP."""
    h, normed = rms_norm(linear(x, weight), norm_weight, eps, residual)
    return h, linear(linear_silu_mul(normed, gate_up), down)


def _steps(model) -> list[torch.Tensor]:
    tok = tiny_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("a b c"), tok.encode("xyz")]
    kv = model.allocate_kv_cache(64, 8)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    out = []
    for prompt, table in zip(prompts, tables, strict=True):
        out.append(model(ForwardBatch.build([prompt], [0], [table], block_size=8), kv))
    lens = [len(p) for p in prompts]
    for step in range(3):  # decode: one row, then all five rows
        one = ForwardBatch.build([[7 + step]], [lens[0] + step], [tables[0]], block_size=8)
        out.append(model(one, kv))
    five = ForwardBatch.build(
        [[11]] * 5, [n + 3 if i == 0 else n for i, n in enumerate(lens)], tables, block_size=8
    )
    out.append(model(five, kv))
    return out


def test_every_layer_fuses_and_the_logits_are_the_same_bits(monkeypatch) -> None:
    model, config = build_tiny()
    calls = []
    fused = llama.linear_add_rms_norm_swiglu

    def counting(x, *args):
        calls.append(x.shape[0])
        return fused(x, *args)

    monkeypatch.setattr(llama, "linear_add_rms_norm_swiglu", counting)
    got = _steps(model)
    per_forward = config.num_layers
    assert len(calls) == per_forward * len(got)
    assert calls[-per_forward:] == [5] * per_forward and 1 in calls
    if native.supports_device(torch.device("cpu")):
        assert native_row_limit() >= 5  # the decode steps above took the native call
    monkeypatch.setattr(llama, "linear_add_rms_norm_swiglu", _separate)
    want = _steps(model)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def separate_tokens() -> list[list[int]]:
    return greedy_tokens(replace=("linear_add_rms_norm_swiglu", _separate))


@pytest.mark.parametrize("kvp", [1, 2])
def test_greedy_tokens_unchanged(separate_tokens, kvp: int) -> None:
    assert greedy_tokens(kvp) == separate_tokens
