"""GGUF files written the way llama.cpp's converter writes them, with the ``gguf`` package.

:func:`write_gguf` takes a Hugging Face Llama state dict (from a checkpoint
transformers wrote) and stores it under llama.cpp's names, with the Q and K
rows permuted as ``convert_hf_to_gguf.py`` permutes them, quantized with
``gguf.quants.quantize``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medha_runtime.model.gguf import gguf_name


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (rotate-half → interleaved pairs), per head."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` llama.cpp's converter writes for a ``llama3`` rope dict."""
    theta = rope["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    qtype: str = "F32",
    tokenizer: dict[str, Any] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """Write ``state`` (Hugging Face names) as a llama GGUF.

    Args:
        path: the file to write.
        state: fp32 tensors under Hugging Face names.
        config: the transformers ``config.json`` dict (plain RoPE only).
        qtype: the type of every 2-D weight (``F32``, ``F16``, ``BF16``, ``Q8_0``,
            ``Q4_0``, ``Q4_1``); norms stay F32.
        tokenizer: ``tokenizer.ggml.*`` keys to write (without the prefix), or None.
        extra_tensors: more tensors, name → (raw array, GGML type), written as is.
        rope_freqs: llama.cpp's per-frequency RoPE divisors (Llama 3.1 scaling), or None.
    """
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    w.add_rope_freq_base(rope_theta)
    w.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if tokenizer:
        for key, value in tokenizer.items():
            add = {
                "model": w.add_tokenizer_model,
                "pre": w.add_tokenizer_pre,
                "tokens": w.add_token_list,
                "merges": w.add_token_merges,
                "token_type": w.add_token_types,
                "bos_token_id": w.add_bos_token_id,
                "eos_token_id": w.add_eos_token_id,
            }[key]
            add(value)
    q = gguf.GGMLQuantizationType[qtype]
    for name, tensor in state.items():
        target = gguf_name(name)
        assert target is not None, name
        data = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            data = permute_rows(data, heads)
        elif name.endswith("k_proj.weight"):
            data = permute_rows(data, kv_heads)
        if data.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(target, np.ascontiguousarray(data))
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(target, data.astype(np.float16))
        else:
            raw = gguf.quants.quantize(data, q)
            w.add_tensor(target, raw, raw_shape=raw.shape, raw_dtype=q)
    for target, (raw, kind) in (extra_tensors or {}).items():
        w.add_tensor(target, raw, raw_shape=raw.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
