"""RoPE numerics against transformers' ROPE_INIT_FUNCTIONS and LlamaRotaryEmbedding."""

from __future__ import annotations

import pytest
import torch

from medha_runtime.model import ModelConfig
from medha_runtime.model.rope import RotaryEmbedding, apply_rotary, inv_freq

transformers = pytest.importorskip("transformers")

HEAD_DIM, MAX_POS = 64, 4096
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "attention_factor": 0.8,
    },
}


def _configs(rope: dict):
    hf = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(rope),
    )
    ours = ModelConfig.from_hf_dict(hf.to_dict(), source="test")
    return hf, ours


def _reference(hf, seq_len=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_inverse_frequencies_and_scale_match_transformers(name: str) -> None:
    hf, ours = _configs(ROPES[name])
    expected, expected_scale = _reference(hf)
    got, scale = inv_freq(ours.rope, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    assert torch.equal(got, expected.float())
    assert scale == pytest.approx(expected_scale, rel=1e-12)
    if name not in ("default", "dynamic"):  # scaling must actually change something
        plain, _ = inv_freq(
            ours.rope.__class__(theta=ours.rope.theta),
            head_dim=HEAD_DIM,
            max_position_embeddings=MAX_POS,
        )
        assert not torch.equal(got, plain)


@pytest.mark.parametrize("seq_len", [100, MAX_POS, 3 * MAX_POS, 2 * MAX_POS])
def test_dynamic_ntk_matches_transformers_for_any_length(seq_len: int) -> None:
    hf, ours = _configs(ROPES["dynamic"])
    expected, _ = _reference(hf, seq_len=seq_len)
    got, _ = inv_freq(
        ours.rope, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS, seq_len=seq_len
    )
    assert torch.equal(got, expected)


def test_model_fixes_the_dynamic_base_at_factor_times_context() -> None:
    hf, ours = _configs(ROPES["dynamic"])
    rotary = RotaryEmbedding(ours.rope, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    expected, _ = _reference(hf, seq_len=2 * MAX_POS)
    assert torch.equal(rotary.inv_freq, expected)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "yarn-mscale"])
def test_cos_sin_and_rotation_match_transformers(name: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf, ours = _configs(ROPES[name])
    positions = torch.tensor([0, 1, 7, 511, 512, 1500, MAX_POS - 1])
    x = torch.zeros(1, len(positions), HEAD_DIM)
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf)(x, positions[None])
    rotary = RotaryEmbedding(ours.rope, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    cos, sin = rotary.cos_sin(positions)
    half = HEAD_DIM // 2
    torch.testing.assert_close(cos, cos_hf[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, sin_hf[0, :, :half], atol=1e-6, rtol=0)
    table_cos, _ = rotary.cos_sin_cache(MAX_POS)
    assert table_cos.shape == (MAX_POS, half)
    torch.testing.assert_close(table_cos[positions], cos)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=g)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=g)
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf
    )
    q_ours, k_ours = rotary.apply_rope(q, k, positions)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(apply_rotary(q, cos, sin), q_ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_in_place_rotation_with_step_tables_is_bit_identical(dtype: torch.dtype) -> None:
    """apply_rotary_ on the q/k heads of a fused QKV output: transformers' rotation, bitwise."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from medha_runtime.model.rope import apply_rotary_, rotary_tables

    hf, ours = _configs(ROPES["llama3"])
    positions = torch.tensor([0, 3, 511, 512, 2047, MAX_POS - 1])
    n, hq, hkv = len(positions), 4, 2
    rotary = RotaryEmbedding(ours.rope, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    cos, sin = rotary.cos_sin(positions, dtype)
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(n, (hq + 2 * hkv) * HEAD_DIM, generator=g) * 3).to(dtype)
    v_before = qkv[:, (hq + hkv) * HEAD_DIM :].clone()
    qk = qkv[:, : (hq + hkv) * HEAD_DIM].view(n, hq + hkv, HEAD_DIM)  # strided, as in the layer
    q, k = qk[:, :hq].clone(), qk[:, hq:].clone()

    apply_rotary_(qk, *rotary_tables(cos, sin))

    assert torch.equal(qk[:, :hq], apply_rotary(q, cos, sin))
    assert torch.equal(qk[:, hq:], apply_rotary(k, cos, sin))
    assert torch.equal(qkv[:, (hq + hkv) * HEAD_DIM :], v_before)  # v untouched
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf.to(dtype), sin_hf.to(dtype)
    )
    if dtype == torch.float32:  # the tables differ from transformers' by fp32 rounding only
        torch.testing.assert_close(qk[:, :hq], q_hf[0].transpose(0, 1), atol=1e-4, rtol=1e-5)
    else:  # the 16-bit tables round to the same values: the rotation is bit-identical
        assert torch.equal(cos, cos_hf[0, :, : HEAD_DIM // 2].to(dtype))
        assert torch.equal(qk[:, :hq], q_hf[0].transpose(0, 1))
        assert torch.equal(qk[:, hq:], k_hf[0].transpose(0, 1))
