"""medha_runtime's Llama against transformers' own, on checkpoints transformers wrote."""

from __future__ import annotations

import math

import pytest
import torch

from medha_kernels import chunked_prefill_attention, merge_state
from medha_runtime.model import ForwardBatch, load_model
from tests.numerics import assert_twice_torch
from tests.runtime.checkpoints import (
    SPECS,
    greedy,
    hf_greedy,
    hf_logits,
    hf_model,
    shuffled_blocks,
)

PROMPT = [1, 17, 42, 5, 88, 23, 61, 9, 70, 33, 14, 50, 3]
MAX_NEW = 12


@pytest.mark.parametrize("name", sorted(SPECS))
def test_prompt_logits_match_transformers(checkpoint, name: str) -> None:
    path = checkpoint(name)
    truth = hf_logits(path, PROMPT, torch.float64)
    baseline = hf_logits(path, PROMPT, torch.float32)  # transformers in the same precision
    model, config = load_model(path, dtype="float32")
    kv = model.allocate_kv_cache(8, 4)
    batch = ForwardBatch.build([PROMPT], [0], [[3, 0, 7, 1]], block_size=4)
    batch.sample_rows = torch.arange(len(PROMPT))  # logits for every row
    got = model(batch, kv)
    assert got.dtype == torch.float32 and got.shape == (len(PROMPT), config.vocab_size)
    assert_twice_torch(got, truth, baseline, what=f"{name} logits")


GREEDY_SPECS = ["gqa-llama3-tied-sharded", "gqa-llama3-legacy", "mha-default-legacy"]


@pytest.mark.parametrize("name", GREEDY_SPECS)
def test_greedy_matches_transformers_for_every_chunk_size(checkpoint, name: str) -> None:
    path = checkpoint(name)
    expected = hf_greedy(hf_model(path), PROMPT, MAX_NEW)
    assert len(set(expected)) > 2, "degenerate reference; pick another seed"
    model, _ = load_model(path, dtype="float32")
    for chunk in (1, 3, 7, len(PROMPT)):
        assert greedy(model, PROMPT, MAX_NEW, chunk=chunk) == expected, f"chunk={chunk}"


def test_mixed_batches_of_prefill_chunks_and_decodes_match_transformers(checkpoint) -> None:
    """Two sequences share every step: one decodes while the other is still prefilling."""
    path = checkpoint("gqa-llama3-tied-sharded")
    ref = hf_model(path)
    prompts = [PROMPT, [1, 90, 4, 4, 66]]
    expected = [hf_greedy(ref, p, MAX_NEW) for p in prompts]
    model, _ = load_model(path, dtype="float32")
    bs, chunk = 4, 3
    kv = model.allocate_kv_cache(32, bs)
    pool = shuffled_blocks(32, seed=7)
    blocks = [pool[0::2], pool[1::2]]  # interleaved blocks of the two sequences
    done = [0, 0]  # tokens of each sequence already in the cache
    outs: list[list[int]] = [[], []]
    while any(len(o) < MAX_NEW for o in outs):
        toks, starts, tables, sample, who = [], [], [], [], []
        for s, prompt in enumerate(prompts):
            if len(outs[s]) == MAX_NEW:
                continue
            prefilling = done[s] < len(prompt)
            piece = prompt[done[s] : done[s] + chunk] if prefilling else outs[s][-1:]
            end = done[s] + len(piece)
            toks.append(piece)
            starts.append(done[s])
            tables.append(blocks[s][: math.ceil(end / bs)])
            sample.append(end >= len(prompt))
            who.append(s)
            done[s] = end
        batch = ForwardBatch.build(toks, starts, tables, block_size=bs, sample=sample)
        logits = model(batch, kv)
        sampled = [s for s, flag in zip(who, sample, strict=True) if flag]
        for row, s in enumerate(sampled):
            outs[s].append(int(logits[row].argmax()))
    assert outs == expected


def test_pipeline_stages_compose_to_the_whole_model(checkpoint) -> None:
    path = checkpoint("gqa-llama3-legacy")
    whole, config = load_model(path, dtype="float32")
    first, _ = load_model(path, dtype="float32", layer_range=range(0, 1))
    last, _ = load_model(path, dtype="float32", layer_range=range(1, config.num_layers))
    assert first.is_first and not first.is_last and last.is_last and not last.is_first
    assert not hasattr(first, "lm_head") and not hasattr(last, "embed_tokens")
    batch = ForwardBatch.build([PROMPT], [0], [[0, 1, 2, 3]], block_size=4)
    expected = whole(batch, whole.allocate_kv_cache(4, 4))
    hidden = first(batch, first.allocate_kv_cache(4, 4))
    assert hidden.shape == (len(PROMPT), config.hidden_size)
    with pytest.raises(ValueError, match="hidden states"):
        last(batch, last.allocate_kv_cache(4, 4))
    got = last(batch, last.allocate_kv_cache(4, 4), hidden)
    truth = hf_logits(path, PROMPT, torch.float64)[-1:]  # the batch samples the last row
    assert_twice_torch(got, truth, expected, what="staged logits")


class SplitKVAttention:
    """A KVP-style hook: attend to two key shards separately, then merge the states."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q, k_cache, v_cache, batch, *, layer_id):
        self.calls += 1
        bs = k_cache.shape[1]
        out = torch.empty_like(q)
        cu, lens = batch.cu_seqlens_q.tolist(), batch.kv_lens.tolist()
        for b, kv_len in enumerate(lens):
            lo, hi = cu[b], cu[b + 1]
            blocks = batch.block_table[b, : -(-kv_len // bs)].long()
            k = k_cache[blocks].flatten(0, 1)[:kv_len]
            v = v_cache[blocks].flatten(0, 1)[:kv_len]
            split = (kv_len - (hi - lo)) // 2  # shard 0 lies wholly before the queries
            o0, s0 = chunked_prefill_attention(q[lo:hi], k[:split], v[:split], causal=False)
            o1, s1 = chunked_prefill_attention(q[lo:hi], k[split:], v[split:])
            out[lo:hi] = merge_state(o0, s0, o1, s1)[0]
        return out


def test_attention_hook_replaces_attention_in_every_layer(checkpoint) -> None:
    path = checkpoint("gqa-yarn")
    model, config = load_model(path, dtype="float32")
    expected = greedy(model, PROMPT, MAX_NEW, chunk=5)
    hook = SplitKVAttention()
    model.set_attention(hook)
    assert greedy(model, PROMPT, MAX_NEW, chunk=5) == expected
    steps = math.ceil(len(PROMPT) / 5) + MAX_NEW - 1
    assert hook.calls == steps * config.num_layers


def test_bfloat16_weights_and_fp32_logits(checkpoint) -> None:
    path = checkpoint("gqa-llama3-tied-sharded")
    model32, _ = load_model(path, dtype="float32")
    model16, _ = load_model(path, dtype="bfloat16")
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    batch = ForwardBatch.build([PROMPT], [0], [[0, 1, 2, 3]], block_size=4)
    kv16 = model16.allocate_kv_cache(4, 4)
    assert kv16.k[0].dtype == torch.bfloat16
    got = model16(batch, kv16)
    ref = model32(batch, model32.allocate_kv_cache(4, 4))
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
