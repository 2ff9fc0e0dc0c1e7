"""The built-in tiny model: deterministic, long-context, and round-trips through the loader."""

from __future__ import annotations

import json

import pytest
import torch

import medha_runtime.model.tiny as tiny
from medha_runtime.model import ForwardBatch, load_model
from medha_runtime.model.tiny import build_tiny, save_tiny, tiny_config, tiny_tokenizer
from tests.numerics import assert_twice_torch

PROMPT = tiny_tokenizer().encode("Medha serves long prompts.")


def _logits(model, prompt=PROMPT, offset: int = 0) -> torch.Tensor:
    batch = ForwardBatch.build([prompt], [0], [[2, 0, 1, 3]], block_size=8)
    batch.sample_rows = torch.arange(len(prompt))
    batch.positions += offset  # RoPE positions only; the cache holds just the prompt
    return model(batch, model.allocate_kv_cache(4, 8))


def test_same_seed_same_logits_other_seed_other_logits() -> None:
    a, _ = build_tiny()
    b, _ = build_tiny()
    c, _ = build_tiny(seed=1)
    la, lb, lc = _logits(a), _logits(b), _logits(c)
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)
    # Varied, decisive output: not one repeated token, and no near-ties.
    top = la.topk(2, dim=-1)
    assert len(set(top.indices[:, 0].tolist())) > 3
    assert (top.values[:, 0] - top.values[:, 1]).min() > 1e-3


def test_config_is_a_long_context_llama3_shape() -> None:
    c = tiny_config()
    assert c.max_position_embeddings >= 65536
    assert (c.vocab_size, c.num_q_heads, c.num_kv_heads, c.head_dim) == (259, 4, 2, 16)
    assert c.rope.rope_type == "llama3" and c.tie_word_embeddings
    assert "random" in tiny.__doc__.lower()


def test_decodes_at_the_end_of_its_64k_context() -> None:
    model, config = build_tiny()
    n, bs = config.max_position_embeddings, 1024
    kv = model.allocate_kv_cache(n // bs, bs)
    blocks = list(range(n // bs))
    prefix = ForwardBatch.build([PROMPT], [0], [blocks[:1]], block_size=bs)
    first = model(prefix, kv)
    # The last position: the cache holds the prompt then zeros, as if prefilled.
    last = ForwardBatch.build([[PROMPT[-1]]], [n - 1], [blocks], block_size=bs)
    logits = model(last, kv)
    assert logits.shape == (1, 259) and torch.isfinite(logits).all()
    assert not torch.allclose(logits, first)


def test_save_then_load_gives_identical_logits(tmp_path) -> None:
    path = save_tiny(tmp_path / "tiny")
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (path / name).is_file(), name
    assert "RANDOM" in (path / "README.md").read_text()
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 65536
    loaded, config = load_model(path)
    assert config == tiny_config()
    built, _ = load_model("tiny")
    assert torch.equal(_logits(loaded), _logits(built))


def test_transformers_reads_the_saved_tiny_model(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    path = save_tiny(tmp_path / "tiny")
    model, config = build_tiny()
    # The prompt at the start, then the same tokens at the very end of the 64K context.
    offset = config.max_position_embeddings - len(PROMPT)
    refs = {}
    for dtype in (torch.float64, torch.float32):  # the truth, and transformers' fp32 baseline
        ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
        positions = torch.arange(offset, offset + len(PROMPT))[None]
        with torch.no_grad():
            near = ref(torch.tensor([PROMPT])).logits[0]
            far = ref(torch.tensor([PROMPT]), position_ids=positions).logits[0]
        refs[dtype] = near, far
    (near64, far64), (near32, far32) = refs[torch.float64], refs[torch.float32]
    assert not torch.allclose(far64, near64, atol=1e-2)
    assert_twice_torch(_logits(model), near64, near32, what="logits at position 0")
    assert_twice_torch(_logits(model, offset=offset), far64, far32, what="logits at 64K")


def test_a_built_batch_plans_its_attention_without_reading_the_device(monkeypatch) -> None:
    """``ForwardBatch.build`` keeps the host lists it made its tensors from, so the
    step's attention plan reads nothing back (on a GPU: no sync per step), and the
    logits equal those of a batch planned from its tensors."""
    model, _ = build_tiny()
    blocks = [[2, 0, 1, 3], [5, 4]]
    prompts = [PROMPT, PROMPT[:9]]
    built = ForwardBatch.build(prompts, [0, 0], blocks, block_size=8)
    assert built.host is not None and built.host.max_block == 5
    assert list(built.host.cu_seqlens_q) == built.cu_seqlens_q.tolist()
    bare = ForwardBatch.build(prompts, [0, 0], blocks, block_size=8)
    bare.host = None

    def no_read(*args, **kwargs):
        raise AssertionError("the plan read the device")

    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    monkeypatch.setattr(torch.Tensor, "item", no_read)
    plan = built.attention_plan(
        num_qo_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32
    )
    monkeypatch.undo()
    assert plan.meta.max_block == 5
    out = model(built, model.allocate_kv_cache(6, 8))
    assert torch.equal(out, model(bare, model.allocate_kv_cache(6, 8)))
