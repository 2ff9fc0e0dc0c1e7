"""Model configuration read from a Hugging Face ``config.json``.

Two RoPE forms are accepted, as transformers writes them:

- current: ``"rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}``;
- legacy: top-level ``"rope_theta"`` plus ``"rope_scaling": {"type" or "rope_type": ...}``
  (``null`` for plain RoPE).

Only ``LlamaForCausalLM`` (Llama 2, 3, 3.1, 3.2 shapes) is supported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from medha_runtime.config import canonical_dtype
from medha_runtime.model.errors import ConfigError, ModelLoadError, UnsupportedModelError
from medha_runtime.tokenizer import token_ids

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_ROPE_THETA = 10000.0

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name (``"float32"``, ``"float16"``, ``"bfloat16"``) of a dtype or alias."""
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
        raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(_DTYPES)}")
    name = canonical_dtype(dtype)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return name


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig | None = None) -> torch.dtype:
    """A torch dtype from a dtype, a name, or ``"auto"`` (the config's own dtype)."""
    if isinstance(dtype, str) and dtype == "auto":
        if config is None:
            raise ValueError('dtype "auto" needs a model config')
        return _DTYPES[config.dtype]
    return _DTYPES[dtype_name(dtype)]


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeConfig:
    """Rotary position embedding parameters (see :mod:`medha_runtime.model.rope`).

    Attributes:
        rope_type: ``"default"``, ``"linear"``, ``"dynamic"``, ``"llama3"`` or ``"yarn"``.
        theta: the base wavelength (``rope_theta``).
        factor: the scaling factor (all types but default).
        original_max_position_embeddings: the pretraining context (llama3, yarn).
        low_freq_factor, high_freq_factor: llama3 smoothing bounds.
        beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate: yarn.
    """

    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta={self.theta} and factor={self.factor} must be > 0")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and (
            self.low_freq_factor is None or self.high_freq_factor is None
        ):
            raise ValueError("rope_type 'llama3' needs low_freq_factor and high_freq_factor")

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``rope_parameters`` dict (current transformers form)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type != "default":
            out["factor"] = self.factor
        if self.rope_type in ("llama3", "yarn"):
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A Llama-family model's shape.

    Attributes:
        vocab_size, hidden_size, intermediate_size: the usual sizes.
        num_layers: decoder layers (``num_hidden_layers``).
        num_q_heads: query heads (``num_attention_heads``).
        num_kv_heads: key/value heads (``num_key_value_heads``; GQA when fewer).
        head_dim: per-head size (``head_dim``, default ``hidden_size // num_q_heads``).
        rms_norm_eps: RMSNorm epsilon.
        rope: the RoPE parameters.
        max_position_embeddings: the context the config declares.
        tie_word_embeddings: the LM head reuses the token embedding.
        bos_token_id: or None.
        eos_token_ids: every EOS id in ``config.json`` (int or list there).
        dtype: the checkpoint's dtype name (``"bfloat16"``...), used for ``dtype="auto"``.
        attention_bias, mlp_bias: whether the projections carry biases.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse and validate a transformers ``config.json`` dict.

        Args:
            d: the parsed JSON.
            source: what to name in error messages (the file's path).

        Raises:
            UnsupportedModelError: not ``LlamaForCausalLM``, quantized weights, an
                activation other than SiLU, or an unsupported RoPE type.
            ConfigError: a required field is missing or a value is invalid.
        """
        _check_architecture(d, source)
        get = _FieldReader(d, source)
        vocab_size = get.pos_int("vocab_size")
        hidden_size = get.pos_int("hidden_size")
        num_q_heads = get.pos_int("num_attention_heads")
        num_kv_heads = get.pos_int("num_key_value_heads", default=num_q_heads)
        head_dim = get.pos_int("head_dim", default=None) or hidden_size // num_q_heads
        max_pos = get.pos_int("max_position_embeddings", default=2048)
        raw_dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        try:
            dtype = dtype_name(str(raw_dtype))
        except ValueError as exc:
            raise UnsupportedModelError(
                f"{source}: dtype {raw_dtype!r} is not supported ({exc})"
            ) from None
        eos_ids = get.token_ids("eos_token_id")
        try:
            return cls(
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                intermediate_size=get.pos_int("intermediate_size"),
                num_layers=get.pos_int("num_hidden_layers"),
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                rms_norm_eps=get.pos_float("rms_norm_eps", default=1e-6),
                rope=_rope_from_hf(d, max_pos, source),
                max_position_embeddings=max_pos,
                tie_word_embeddings=get.flag("tie_word_embeddings", default=False),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                dtype=dtype,
                attention_bias=get.flag("attention_bias", default=False),
                mlp_bias=get.flag("mlp_bias", default=False),
            )
        except ValueError as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ConfigError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict (current form, ``rope_parameters``) that transformers reads."""
        eos = self.eos_token_ids
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf_dict(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
            "dtype": self.dtype,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
        }


class _FieldReader:
    def __init__(self, d: Mapping[str, Any], source: str) -> None:
        self.d, self.source = d, source

    def pos_int(self, key: str, *, default: Any = ...) -> Any:
        if key not in self.d or self.d[key] is None:
            if default is ...:
                raise ConfigError(f"{self.source}: required field {key!r} is missing")
            return default
        value = self.d[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{self.source}: {key} must be a positive int, got {value!r}")
        return value

    def pos_float(self, key: str, *, default: float) -> float:
        value = self.d.get(key)
        if value is None:
            return default
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 < value < math.inf
        ):
            raise ConfigError(f"{self.source}: {key} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, *, default: bool) -> bool:
        value = self.d.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        """A token id or a list of them (absent or null: none)."""
        return tuple(token_ids(self.d.get(key), self.source, key))


def _check_architecture(d: Mapping[str, Any], source: str) -> None:
    archs = d.get("architectures")
    if archs is None:
        if d.get("model_type") != "llama":
            raise UnsupportedModelError(
                f"{source}: no 'architectures' and model_type {d.get('model_type')!r}; "
                f"medha_runtime runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    else:
        if not isinstance(archs, (str, list)):
            raise ConfigError(f"{source}: architectures must be a list of names, got {archs!r}")
        archs = [archs] if isinstance(archs, str) else archs
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise UnsupportedModelError(
                f"{source}: architecture {', '.join(map(str, archs)) or '(none)'} is not "
                f"supported; medha_runtime runs {', '.join(SUPPORTED_ARCHITECTURES)} "
                "(Llama 2, 3, 3.1, 3.2)"
            )
    if d.get("quantization_config"):
        quant = d["quantization_config"]
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
        raise UnsupportedModelError(f"{source}: quantized weights ({method}) are not supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")


def _rope_from_hf(d: Mapping[str, Any], max_pos: int, source: str) -> RopeConfig:
    if d.get("rope_parameters") is not None:
        where, raw = "rope_parameters", d["rope_parameters"]
    else:
        where, raw = "rope_scaling", d.get("rope_scaling") or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: {where} must be an object, got {raw!r}")
    if raw and all(isinstance(v, Mapping) for v in raw.values()):
        raise UnsupportedModelError(
            f"{source}: per-layer-type {where} ({', '.join(raw)}) is not supported"
        )
    theta = raw.get("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA))
    rtype = raw.get("rope_type", raw.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: {where}.rope_type {rtype!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if raw.get("partial_rotary_factor", 1.0) != 1.0 or d.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor != 1 is not supported")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ConfigError(f"{source}: {where}.{key} is required for rope_type {rtype!r}")
        return raw[key]

    def num(key: str, value: Any, cast: type = float) -> Any:
        """``cast(value)``; a value that is not a finite number (with ``cast=int``: a
        whole number >= 1) is a ConfigError naming it."""
        try:
            out = float(value)
        except (TypeError, ValueError):
            out = None
        if out is None or isinstance(value, bool) or not math.isfinite(out):
            raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
        if cast is int:
            if not out.is_integer() or out < 1:
                raise ConfigError(f"{source}: {key} must be a whole number >= 1, got {value!r}")
            return int(out)
        return out

    theta_key = f"{where}.rope_theta" if "rope_theta" in raw else "rope_theta"
    kw: dict[str, Any] = {"rope_type": rtype, "theta": num(theta_key, theta)}
    if rtype in ("linear", "dynamic", "llama3"):
        kw["factor"] = num(f"{where}.factor", need("factor"))
    if rtype in ("llama3", "yarn"):
        orig = raw.get("original_max_position_embeddings") or max_pos
        orig = num(f"{where}.original_max_position_embeddings", orig, int)
        kw["original_max_position_embeddings"] = orig
    if rtype == "llama3":
        kw["low_freq_factor"] = num(f"{where}.low_freq_factor", need("low_freq_factor"))
        kw["high_freq_factor"] = num(f"{where}.high_freq_factor", need("high_freq_factor"))
    if rtype == "yarn":
        factor = raw.get("factor")
        kw["factor"] = num(f"{where}.factor", factor) if factor is not None else max_pos / orig
        kw["beta_fast"] = num(f"{where}.beta_fast", raw.get("beta_fast") or 32.0)
        kw["beta_slow"] = num(f"{where}.beta_slow", raw.get("beta_slow") or 1.0)
        truncate = raw.get("truncate", True)
        if truncate is None:  # transformers reads a null as false
            truncate = False
        if not isinstance(truncate, bool):
            raise ConfigError(f"{source}: {where}.truncate must be true or false, got {truncate!r}")
        kw["truncate"] = truncate
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if raw.get(key) is not None:
                kw[key] = num(f"{where}.{key}", raw[key])
    try:
        return RopeConfig(**kw)
    except ValueError as exc:
        raise ConfigError(f"{source}: {where}: {exc}") from None
