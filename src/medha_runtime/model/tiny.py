"""``tiny``: the built-in default model, for trying Medha with no download.

**Its weights are random** (drawn from a fixed seed), so its output is
gibberish: it exists to exercise the whole runtime (paged KV, chunked prefill,
TP/SPP/KVP, long contexts) on a fresh CPU machine, not to say anything.

- A Llama 3 shape: hidden 64, 4 layers, 4 query / 2 KV heads (GQA), head_dim 16,
  SwiGLU 128, tied embeddings, llama3 RoPE (theta 500000, factor 8 over 8192),
  a 65536-token context.
- A byte-level tokenizer: ids 0-255 are the bytes, then ``<s>`` (256, BOS),
  ``</s>`` (257, EOS) and ``<pad>`` (258); any UTF-8 text round-trips.
- A small chat template (``<|role|>`` headers, turns end with ``</s>``).

Everything is built in memory; :func:`save_tiny` writes the same model as a
Hugging Face directory (which transformers can load too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors

from medha_parallel import TPCommunicator
from medha_runtime.model.config import ModelConfig, RopeConfig
from medha_runtime.model.llama import LlamaModel
from medha_runtime.model.loader import DictSource, load_weights
from medha_runtime.tokenizer import bytes_to_unicode

if TYPE_CHECKING:
    from medha_runtime.tokenizer import Tokenizer

TINY_SEED = 0
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
README = """# tiny (Medha's built-in model)

The weights in this directory are RANDOM (seed {seed}); the model's output is
gibberish. It exists to exercise the Medha runtime without downloading
anything. Tokenizer: bytes 0-255, then <s> (256), </s> (257), <pad> (258).
"""


def tiny_config() -> ModelConfig:
    """The tiny model's shape (see the module docstring)."""
    return ModelConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope=RopeConfig(
            rope_type="llama3",
            theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=65536,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        dtype="float32",
    )


def tiny_state_dict(seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """Random fp32 weights under Hugging Face names, the same for a given seed everywhere.

    Projections are N(0, 4/fan_in) and the (tied) embedding N(0, 1): every layer
    moves the residual stream, greedy output varies, and logits are peaked
    enough that the top token is not a near tie.
    """
    c = tiny_config()
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    h, ffn = c.hidden_size, c.intermediate_size
    q, kv = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": randn(c.vocab_size, h, std=1.0)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = randn(q, h, std=2 * h**-0.5)
        out[p + "self_attn.k_proj.weight"] = randn(kv, h, std=2 * h**-0.5)
        out[p + "self_attn.v_proj.weight"] = randn(kv, h, std=2 * h**-0.5)
        out[p + "self_attn.o_proj.weight"] = randn(h, q, std=2 * q**-0.5)
        out[p + "mlp.gate_proj.weight"] = randn(ffn, h, std=2 * h**-0.5)
        out[p + "mlp.up_proj.weight"] = randn(ffn, h, std=2 * h**-0.5)
        out[p + "mlp.down_proj.weight"] = randn(h, ffn, std=2 * ffn**-0.5)
        out[p + "input_layernorm.weight"] = 1.0 + randn(h, std=0.1)
        out[p + "post_attention_layernorm.weight"] = 1.0 + randn(h, std=0.1)
    out["model.norm.weight"] = 1.0 + randn(h, std=0.1)
    return out


def build_tiny(
    *,
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    tp: TPCommunicator | None = None,
    layer_range: range | None = None,
    seed: int = TINY_SEED,
) -> tuple[LlamaModel, ModelConfig]:
    """This rank's stage of the tiny model, in memory. Returns ``(model, config)``."""
    config = tiny_config()
    model = LlamaModel(config, dtype=dtype, device="meta", tp=tp, layer_range=layer_range)
    load_weights(model, DictSource(tiny_state_dict(seed), label="tiny"), device=device)
    return model, config


def tiny_fast_tokenizer() -> tokenizers.Tokenizer:
    """The byte-level ``tokenizers.Tokenizer``: id ``b`` is byte ``b``; BOS is prepended."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def tiny_tokenizer() -> Tokenizer:
    """The tiny model's tokenizer, chat template and stop ids."""
    from medha_runtime.tokenizer import Tokenizer

    return Tokenizer(
        tiny_fast_tokenizer(),
        bos_token=BOS,
        eos_token=EOS,
        chat_template=TINY_CHAT_TEMPLATE,
        generation_eos_ids=(EOS_ID,),
    )


def save_tiny(path: str | Path, *, seed: int = TINY_SEED) -> Path:
    """Write the tiny model as a Hugging Face directory and return its path.

    Files: config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json (with the chat template), generation_config.json
    and a README.md stating that the weights are random.
    """
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    save_file(tiny_state_dict(seed), str(directory / "model.safetensors"), {"format": "pt"})
    tiny_fast_tokenizer().save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": config.max_position_embeddings,
        "chat_template": TINY_CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (directory / "README.md").write_text(README.format(seed=seed))
    return directory
