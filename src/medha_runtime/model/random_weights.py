"""``random:CONFIG``: a model of any supported shape with random weights, made on the device.

``CONFIG`` is a Hugging Face ``config.json`` file, or a directory holding one
(and, if wanted, a ``tokenizer.json``). Only the config is read: no weight
file is needed, and every weight is drawn where it will live, in the model's
dtype, slice by slice as the loader asks for it. So a Llama-3-8B-shaped model
(16 GB in bf16) starts in seconds on a GPU with nothing on disk, for timing
at real shapes. Its output is gibberish.

Draws: projections ``N(0, 1/fan_in)``, the embedding and LM head ``N(0, 1)``,
norm weights 1, biases 0. Each slice comes from its own generator seeded
from ``seed``, the tensor's name and the slice's start, so a given seed and
layout (TP degree) gives the same weights on every run.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from medha_runtime.model.errors import MissingFileError, MissingTensorError

if TYPE_CHECKING:
    from medha_runtime.model.config import ModelConfig

PREFIX = "random:"
RANDOM_SEED = 0


def random_config_path(model: str | Path) -> Path | None:
    """The ``config.json`` a ``random:`` spec names, or None for any other model string.

    Raises:
        MissingFileError: the spec names no file, or a directory without ``config.json``.
    """
    text = str(model)
    if not text.startswith(PREFIX):
        return None
    rest = text[len(PREFIX) :]
    if not rest:
        raise MissingFileError(
            f"model {text!r}: name a config.json (or its directory) after {PREFIX!r}"
        )
    path = Path(rest)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise MissingFileError(f"model {text!r}: {path} is not a file")
    return path


class RandomSource:
    """A :class:`~medha_runtime.model.loader.TensorSource` that draws each slice on demand.

    Args:
        shapes: every checkpoint tensor's full shape, by Hugging Face name.
        device: where slices are drawn.
        dtype: the dtype they are drawn in.
        seed: the base seed.
        label: what errors name.
    """

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        seed: int = RANDOM_SEED,
        label: str = PREFIX,
    ) -> None:
        self.shapes, self.device, self.dtype = shapes, torch.device(device), dtype
        self.seed, self.label = seed, label

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise MissingTensorError(f"{self.label}: tensor {name!r} is missing")
        return self.shapes[name]

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """``tensor[..., start:stop, ...]`` along ``dim`` (all of it when ``dim`` is None)."""
        full = self.shape(name)
        shape = list(full)
        if dim is not None:
            shape[dim] = stop - start
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        if name.endswith("norm.weight"):
            return out.fill_(1.0)
        if name.endswith(".bias"):
            return out.zero_()
        std = 1.0 if "embed_tokens" in name or "lm_head" in name else full[-1] ** -0.5
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + start) % 2**63)
        return out.normal_(0.0, std, generator=g)

    def where(self, name: str) -> str:
        return self.label


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Llama checkpoint of ``config``'s shape, by name."""
    c = config
    h, ffn, d = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_q_heads * d, c.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out |= {
            a + "q_proj.weight": (q, h),
            a + "k_proj.weight": (kv, h),
            a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q),
            m + "gate_proj.weight": (ffn, h),
            m + "up_proj.weight": (ffn, h),
            m + "down_proj.weight": (h, ffn),
            f"model.layers.{i}.input_layernorm.weight": (h,),
            f"model.layers.{i}.post_attention_layernorm.weight": (h,),
        }
        if c.attention_bias:
            out |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
            out[a + "o_proj.bias"] = (h,)
        if c.mlp_bias:
            out |= {m + "gate_proj.bias": (ffn,), m + "up_proj.bias": (ffn,)}
            out[m + "down_proj.bias"] = (h,)
    out["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    return out
