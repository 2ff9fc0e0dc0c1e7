"""A decode layer from its input norm through q/k/v, rotary and the K/V write in one
native call (``rms_norm_qkv_rotary``) leaves the tiny model's logits, its KV cache and its
greedy tokens exactly as the separate calls (``RMSNorm``, ``LlamaAttention.attention``)
gave them.

In process: every layer takes the fused call, on batches whose write is prepared
(every row's slot: the call writes the K/V), not prepared (the batch's own first write),
and with rows that write nothing (a KVP group's prefix rows: the batch writes the rest);
the logits and caches equal, bit for bit, those of the separate calls. Across processes:
greedy tokens of kvp=1 and kvp=2 engines equal one process's tokens with the separate calls.
"""

from __future__ import annotations

import pytest
import torch

import medha_runtime.model.llama as llama
from medha_kernels import native
from medha_runtime.model import ForwardBatch
from medha_runtime.model.tiny import build_tiny, tiny_tokenizer
from tests.runtime.fused_tokens import PROMPTS, greedy_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _declined(*args, **kwargs):
    """The fused call declining every layer: the separate calls run."""
    return None


def _steps(model, kv) -> list[torch.Tensor]:
    tok = tiny_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode("a b c"), tok.encode("xyz")]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    out = []
    for i, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
        batch = ForwardBatch.build([prompt], [0], [table], block_size=8)
        if i % 2:  # prepared: every row's slot known before the forward pass
            batch.prepare_kv_write(kv.k[0])
        out.append(model(batch, kv))
    lens = [len(p) for p in prompts]
    for step in range(3):  # decode: one row, then all five rows
        one = ForwardBatch.build([[7 + step]], [lens[0] + step], [tables[0]], block_size=8)
        one.prepare_kv_write(kv.k[0])
        out.append(model(one, kv))
    five = ForwardBatch.build(
        [[11]] * 5, [n + 3 if i == 0 else n for i, n in enumerate(lens)], tables, block_size=8
    )
    five.prepare_kv_write(kv.k[0])
    out.append(model(five, kv))
    # rows that write nothing (slot -1, a KVP group's view of another group's tail)
    part = ForwardBatch.build([[5], [6]], [lens[1] + 1, lens[2] + 1], tables[1:3], block_size=8)
    part.slots[0] = -1
    part.prepare_kv_write(kv.k[0])
    out.append(model(part, kv))
    return out


def test_every_layer_fuses_and_the_logits_and_cache_are_the_same_bits(monkeypatch) -> None:
    model, config = build_tiny()
    calls = []
    fused = llama.rms_norm_qkv_rotary

    def counting(x, *args):
        got = fused(x, *args)
        calls.append((x.shape[0], got is not None, len(args)))
        return got

    monkeypatch.setattr(llama, "rms_norm_qkv_rotary", counting)
    kv = model.allocate_kv_cache(64, 8)
    got = _steps(model, kv)
    per_forward = config.num_layers
    assert len(calls) == per_forward * len(got)
    if native.supports_device(torch.device("cpu")):
        assert all(ran for _, ran, _ in calls)  # every layer, every batch
        assert {n for n, _, _ in calls} >= {1, 2, 5}
        # the call writes the K/V where every row's slot was prepared, else the batch does
        assert any(n == 11 for *_, n in calls) and any(n == 8 for *_, n in calls)
    monkeypatch.setattr(llama, "rms_norm_qkv_rotary", _declined)
    kv2 = model.allocate_kv_cache(64, 8)
    want = _steps(model, kv2)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kv.k + kv.v, kv2.k + kv2.v, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def separate_tokens() -> list[list[int]]:
    return greedy_tokens(replace=("rms_norm_qkv_rotary", _declined))


@pytest.mark.parametrize("kvp", [1, 2])
def test_greedy_tokens_unchanged(separate_tokens, kvp: int) -> None:
    assert greedy_tokens(kvp) == separate_tokens


def test_forward_and_logits_run_without_autograd(monkeypatch) -> None:
    """``LlamaModel.forward`` and ``compute_logits`` run under ``no_grad`` whether or not
    the caller is (the runner is: the decorator's work is skipped there)."""
    model, _ = build_tiny()
    kv = model.allocate_kv_cache(8, 8)
    seen = []
    layer = next(iter(model.layers.values()))
    forward = layer.forward

    def recording(*args):
        seen.append(torch.is_grad_enabled())
        return forward(*args)

    monkeypatch.setattr(layer, "forward", recording)
    batch = ForwardBatch.build([[1, 2, 3]], [0], [[0]], block_size=8)
    with torch.enable_grad():
        out = model(batch, kv)
        assert torch.is_grad_enabled()
        hidden = torch.randn(2, model.config.hidden_size, requires_grad=True)
        logits = model.compute_logits(hidden)
        assert torch.is_grad_enabled()
    with torch.no_grad():
        again = model(ForwardBatch.build([[1, 2, 3]], [0], [[0]], block_size=8), kv)
    assert seen == [False, False]
    assert not out.requires_grad and not logits.requires_grad and torch.equal(out, again)


@pytest.mark.parametrize("rows", [1, 3])
def test_logits_are_the_hidden_rows_through_the_head(rows: int) -> None:
    """A one-row batch adds the last residual in the final norm's call (no gather): its
    logits, as a batch of several rows', are those of the hidden states' sampled rows
    through ``compute_logits``, bit for bit."""
    model, _ = build_tiny()
    tokens = [[3, 4, 5, 6][:rows]] if rows > 1 else [[9]]
    logits = model(
        ForwardBatch.build(tokens, [2], [[0]], block_size=8), model.allocate_kv_cache(4, 8)
    )
    batch = ForwardBatch.build(tokens, [2], [[0]], block_size=8)
    hidden = model(batch, model.allocate_kv_cache(4, 8), logits=False)
    assert logits.shape == (1, model.config.vocab_size)
    assert torch.equal(logits, model.compute_logits(hidden[batch.sample_rows]))
