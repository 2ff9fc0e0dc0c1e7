"""Transformer shapes for the roofline cost model, with presets.

Shapes describe a Llama-style decoder: grouped-query attention, a SwiGLU MLP
(gate, up and down projections) and an untied output head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from medha_sched.config import _check_float, _check_int
from medha_sched.cost.presets import lookup_preset


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The sizes that set a decoder's FLOPs and bytes.

    Attributes:
        name: label for messages.
        num_layers: decoder layers.
        hidden_size: model width.
        num_q_heads: query heads.
        num_kv_heads: key/value heads (divides ``num_q_heads``).
        head_dim: width of one head.
        intermediate_size: MLP width.
        vocab_size: output-head rows.
        bytes_per_param: bytes of one weight (2 for bf16).
    """

    name: str = "custom"
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    bytes_per_param: float = 2

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for key in (
            "num_layers",
            "hidden_size",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            _check_int(key, getattr(self, key), minimum=1)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_q_heads={self.num_q_heads}"
            )
        _check_float("bytes_per_param", self.bytes_per_param, minimum=0.0, strict=True)

    @property
    def qkv_params(self) -> int:
        """Weights of one layer's fused QKV projection."""
        return self.hidden_size * (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def out_params(self) -> int:
        """Weights of one layer's attention output projection."""
        return self.num_q_heads * self.head_dim * self.hidden_size

    @property
    def mlp_params(self) -> int:
        """Weights of one layer's SwiGLU MLP (three matrices)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def head_params(self) -> int:
        """Weights of the output head (logits)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All weights: layers, output head and input embedding."""
        per_layer = self.qkv_params + self.out_params + self.mlp_params
        return self.num_layers * per_layer + 2 * self.head_params


#: presets by name
MODEL_PRESETS: Mapping[str, ModelShape] = MappingProxyType(
    {
        "llama3-8b": ModelShape(
            name="llama3-8b",
            num_layers=32,
            hidden_size=4096,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
        ),
        "llama3-70b": ModelShape(
            name="llama3-70b",
            num_layers=80,
            hidden_size=8192,
            num_q_heads=64,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
        ),
    }
)


def get_model_shape(name: str) -> ModelShape:
    """The preset called ``name`` (``llama3-8b``, ``llama3-70b``)."""
    return lookup_preset(MODEL_PRESETS, name, "model")
