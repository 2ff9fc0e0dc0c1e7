"""Random tiny Llama checkpoints written by transformers itself, and a greedy loop.

transformers 5 writes the current config form (``rope_parameters``); the
``legacy`` variants rewrite config.json into the old form (top-level
``rope_theta`` plus ``rope_scaling``) by hand.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medha_runtime.model import ForwardBatch, LlamaModel

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@dataclass(frozen=True)
class Spec:
    """One test checkpoint: LlamaConfig kwargs plus how it is saved."""

    name: str
    config: dict[str, Any]
    legacy: bool = False  # rewrite config.json into the rope_scaling form
    legacy_type_key: bool = False  # legacy form spelled {"type": ...}
    shard: str | None = None  # max_shard_size, for a sharded save
    seed: int = 0


BASE = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

SPECS = {
    s.name: s
    for s in [
        # Llama 3.2 shape: GQA, llama3 RoPE, tied embeddings; current form; sharded.
        Spec(
            "gqa-llama3-tied-sharded",
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "tie_word_embeddings": True,
                "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE},
            },
            shard="40KB",
        ),
        # Llama 3.1 shape in the legacy form: GQA, llama3 rope_scaling, untied.
        Spec(
            "gqa-llama3-legacy",
            {
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "tie_word_embeddings": False,
                "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE},
            },
            legacy=True,
            seed=1,
        ),
        # Llama 2 shape: MHA, plain RoPE, untied, legacy form (rope_scaling null).
        Spec(
            "mha-default-legacy",
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            },
            legacy=True,
            seed=2,
        ),
        # Linear scaling written the oldest way: {"type": "linear", "factor": 2}.
        Spec(
            "gqa-linear-legacy-type",
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
            legacy=True,
            legacy_type_key=True,
            seed=3,
        ),
        Spec(
            "gqa-yarn",
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 10000.0,
                    "original_max_position_embeddings": 32,
                },
            },
            seed=4,
        ),
    ]
}


def to_legacy(config: dict[str, Any], *, type_key: bool) -> dict[str, Any]:
    """Rewrite a current-form config.json dict into the legacy rope_scaling form."""
    out = dict(config)
    rope = dict(out.pop("rope_parameters"))
    out["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type") == "default":
        out["rope_scaling"] = None
    else:
        if type_key:
            rope["type"] = rope.pop("rope_type")
        out["rope_scaling"] = rope
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    return out


def build_checkpoint(spec: Spec, directory: Path) -> Path:
    """Save a random LlamaForCausalLM for ``spec`` into ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(**{**BASE, **spec.config})
    model = LlamaForCausalLM(config).eval()
    kw = {"max_shard_size": spec.shard} if spec.shard else {}
    model.save_pretrained(directory, safe_serialization=True, **kw)
    if spec.legacy:
        path = directory / "config.json"
        data = json.loads(path.read_text())
        assert "rope_parameters" in data, "transformers no longer writes the current form"
        path.write_text(json.dumps(to_legacy(data, type_key=spec.legacy_type_key), indent=2))
    return directory


def hf_model(directory: Path, dtype: torch.dtype = torch.float32):
    """The reference: transformers' own model loaded from the directory."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def hf_logits(directory: Path, prompt: list[int], dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits ``[len(prompt), vocab]`` for every prompt position, in ``dtype``."""
    model = hf_model(directory, dtype)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, top_p=None, top_k=None)
    return out[0, len(prompt) :].tolist()


def shuffled_blocks(n: int, seed: int) -> list[int]:
    blocks = list(range(n))
    random.Random(seed).shuffle(blocks)
    return blocks


def greedy(
    model: LlamaModel,
    prompt: list[int],
    max_new: int,
    *,
    chunk: int,
    block_size: int = 4,
    num_blocks: int = 32,
) -> list[int]:
    """Chunked prefill (``chunk`` tokens per step) then one decode per step, greedy."""
    kv = model.allocate_kv_cache(num_blocks, block_size)
    blocks = shuffled_blocks(num_blocks, seed=len(prompt))

    def step(tokens: list[int], start: int, sample: bool) -> torch.Tensor:
        need = math.ceil((start + len(tokens)) / block_size)
        batch = ForwardBatch.build(
            [tokens], [start], [blocks[:need]], block_size=block_size, sample=[sample]
        )
        return model(batch, kv)

    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        logits = step(piece, start, start + len(piece) == len(prompt))
    out: list[int] = []
    while True:
        out.append(int(logits[0].argmax()))
        if len(out) == max_new:
            return out
        logits = step(out[-1:], len(prompt) + len(out) - 1, True)
