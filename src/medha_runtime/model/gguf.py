"""Llama checkpoints in llama.cpp's GGUF format, read with the ``gguf`` package.

One ``.gguf`` file holds the model's shape and tokenizer as metadata and its
tensors under llama.cpp's names (``blk.3.attn_q.weight``...), possibly
quantized. :class:`GGUFCheckpoint` opens and validates a file once:

- the header, the metadata and every tensor's extent are checked up front
  (wrong magic, truncation, an unsupported tensor type: one
  :class:`~medha_runtime.model.errors.CorruptFileError` or
  :class:`~medha_runtime.model.errors.UnsupportedModelError` naming the file
  and the problem, before any weight is built);
- :meth:`GGUFCheckpoint.config` builds the :class:`ModelConfig` from the
  ``llama.*`` keys;
- :class:`GGUFSource` serves tensors under Hugging Face names to the common
  loader (:func:`medha_runtime.model.loader.load_weights`), dequantizing only
  the rows (and block-aligned columns) a TP rank asks for, and undoing
  llama.cpp's row permutation of the Q and K projections.

The tokenizer is built in :mod:`medha_runtime.model.gguf_tokenizer`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medha_runtime.model.config import ModelConfig, RopeConfig
from medha_runtime.model.errors import (
    ConfigError,
    CorruptFileError,
    MissingFileError,
    MissingTensorError,
    UnsupportedModelError,
)

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name for a Hugging Face Llama tensor name (None if it has none)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    return None


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def _reader_class() -> type:
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):  # type: ignore[misc,valid-type]
        """``GGUFReader`` parsing over a plain ndarray view of its memory map.

        Every metadata value is a small view of ``self.data``; views of an
        ``np.memmap`` pay for its ``__array_finalize__`` each time, which made
        a 49k-token vocabulary take seconds to parse. Same bytes, same results.
        """

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)

    return PlainArrayReader


class GGUFCheckpoint:
    """An opened, validated GGUF file (see the module docstring).

    Args:
        path: the ``.gguf`` file.

    Attributes:
        path: the file.
        metadata: every key's value (strings, numbers, lists), except
            ``tokenizer.ggml.*`` arrays, which :meth:`array` reads on demand.
        tensors: llama.cpp tensor name → the reader's tensor record.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise MissingFileError(f"GGUF file {self.path} does not exist")
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise UnsupportedModelError(
                f"{self.path}: reading GGUF files needs the gguf package: pip install 'medha[gguf]'"
            ) from None
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise CorruptFileError(
                f"{self.path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
            )
        try:
            reader = _reader_class()(self.path)
        except Exception:  # the reader fails in many (NumPy-worded) ways on a damaged file
            raise CorruptFileError(
                f"{self.path}: truncated or corrupt GGUF: its header and tensor table "
                f"cannot be read from its {size:,} bytes (download the file again)"
            ) from None
        self._reader = reader
        self.fields = reader.fields
        self.tensors = {t.name: t for t in reader.tensors}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise CorruptFileError(
                    f"{self.path}: truncated: tensor {t.name!r} ends at byte {end}, "
                    f"the file has {size}"
                )
        from medha_runtime.model.dequant import check_supported

        for t in reader.tensors:
            why = check_supported(int(t.tensor_type))
            if why is not None:
                raise UnsupportedModelError(f"{self.path}: tensor {t.name!r}: {why}")
        self.metadata = {k: self.array(k) for k in self.fields if k not in _BIG_ARRAYS}

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, {len(self.tensors)} tensors)"

    # ------------------------------------------------------------------ metadata
    def _value(self, key: str) -> Any:
        from gguf import GGUFValueType

        field = self.fields[key]
        kind = field.types[0] if field.types else None
        if kind == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [field.parts[i][0].item() for i in field.data]
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]][0].item()

    def array(self, key: str) -> Any:
        """A metadata value read now (e.g. ``tokenizer.ggml.tokens``), or None if absent."""
        if key not in self.fields:
            return None
        try:
            return self._value(key)
        except UnicodeDecodeError as exc:
            raise CorruptFileError(f"{self.path}: metadata {key!r} is not UTF-8 ({exc})") from None

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ConfigError(f"{self.path}: metadata 'general.architecture' is missing")
        return arch

    def config(self) -> ModelConfig:
        """The model's shape from the ``{arch}.*`` metadata keys.

        Raises:
            UnsupportedModelError: not a Llama architecture, experts, partial RoPE,
                or RoPE frequency factors (``rope_freqs``) other than Llama 3.1's.
            ConfigError: a required key is missing or invalid (named).
        """
        arch = self.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: architecture {arch!r} is not supported; medha_runtime runs "
                f"GGUF architectures {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        meta = _Keys(self.metadata, f"{arch}.", self.path)
        if meta.get("expert_count", 0):
            raise UnsupportedModelError(f"{self.path}: mixture-of-experts models are not supported")
        hidden = meta.pos_int("embedding_length")
        heads = meta.pos_int("attention.head_count")
        kv_heads = meta.pos_int("attention.head_count_kv", default=heads)
        head_dim = meta.pos_int("attention.key_length", default=hidden // heads)
        if meta.get("attention.value_length", head_dim) != head_dim:
            raise UnsupportedModelError(f"{self.path}: key and value head sizes differ")
        if meta.get("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError(
                f"{self.path}: partial RoPE ({arch}.rope.dimension_count="
                f"{meta.get('rope.dimension_count')} of head_dim {head_dim}) is not supported"
            )
        max_pos = meta.pos_int("context_length", default=2048)
        vocab = meta.get("vocab_size") or self._embedding_rows()
        eos = [
            self.metadata[k]
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if k in self.metadata
        ]
        try:
            return ModelConfig(
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=meta.pos_int("feed_forward_length"),
                num_layers=meta.pos_int("block_count"),
                num_q_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
                rope=self._rope(meta, max_pos),
                max_position_embeddings=max_pos,
                tie_word_embeddings="output.weight" not in self.tensors,
                bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
                dtype=self._auto_dtype(),
                attention_bias="blk.0.attn_q.bias" in self.tensors,
                mlp_bias="blk.0.ffn_up.bias" in self.tensors,
            )
        except ValueError as exc:
            if isinstance(exc, ConfigError | UnsupportedModelError):
                raise
            raise ConfigError(f"{self.path}: {exc}") from None

    def _embedding_rows(self) -> int:
        t = self.tensors.get("token_embd.weight")
        if t is None:
            raise MissingTensorError(f"{self.path}: tensor 'token_embd.weight' is missing")
        return int(t.shape[-1])

    def _rope(self, meta: _Keys, max_pos: int) -> RopeConfig:
        theta = float(meta.get("rope.freq_base", 10000.0))
        if "rope_freqs.weight" in self.tensors:
            return self._llama3_rope(theta, max_pos)
        kind = meta.get("rope.scaling.type", "none")
        factor = meta.get("rope.scaling.factor")
        if kind in ("none", None) or (kind == "linear" and factor in (None, 1.0)):
            return RopeConfig(rope_type="default", theta=theta)
        if kind == "linear":
            return RopeConfig(rope_type="linear", theta=theta, factor=float(factor))
        if kind == "yarn":
            orig = meta.get("rope.scaling.original_context_length") or max_pos
            return RopeConfig(
                rope_type="yarn",
                theta=theta,
                factor=float(factor or max_pos / orig),
                original_max_position_embeddings=int(orig),
            )
        raise UnsupportedModelError(f"{self.path}: RoPE scaling type {kind!r} is not supported")

    def _llama3_rope(self, theta: float, max_pos: int) -> RopeConfig:
        """Llama 3.1-style RoPE from llama.cpp's per-frequency divisors (``rope_freqs``).

        llama.cpp stores ``factors[i]`` with frequency ``i`` used as
        ``freq[i] / factors[i]``: 1 for short wavelengths, ``factor`` for long
        ones, smoothed in between. The smoothing is linear in
        ``1 / wavelength``, so ``low_freq_factor = 1`` plus a line fit (with one
        smoothed frequency or none, thresholds placed in the gaps) recovers
        parameters that give the same frequencies; they are checked to.
        """
        from medha_runtime.model.dequant import dequantize_rows
        from medha_runtime.model.rope import inv_freq

        t = self.tensors["rope_freqs.weight"]
        n = int(t.shape[0])
        factors = dequantize_rows(self.raw_rows(t.name, 0, 1), int(t.tensor_type), n)[0]
        head_dim = 2 * n
        plain, _ = inv_freq(RopeConfig(theta=theta), head_dim=head_dim, max_position_embeddings=2)
        want = plain / factors
        factor = float(factors.max())
        if factor <= 1.0 + 1e-6:
            return RopeConfig(rope_type="default", theta=theta)
        wavelen = (2 * math.pi / plain).double()
        f = factors.double()
        one, full = (f - 1).abs() < 1e-4, (f - factor).abs() < 1e-4 * factor
        mid = ~one & ~full
        if int(mid.sum()) >= 2:
            smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
            a_mat = torch.stack([1 / wavelen[mid], torch.ones_like(smooth)], dim=1)
            a, b = torch.linalg.lstsq(a_mat, smooth.unsqueeze(1)).solution.squeeze(1).tolist()
            high, orig = (1 - 1 / b, -a / b) if b < 0 < a else (float("nan"), float("nan"))
        elif int(mid.sum()) == 0 and one.any() and full.any():
            # both thresholds fall in the gap between the two groups (thirds, in log scale)
            short, long = float(wavelen[one].max()), float(wavelen[full].min())
            orig = short ** (1 / 3) * long ** (2 / 3)
            high = orig / (short ** (2 / 3) * long ** (1 / 3))
        elif int(mid.sum()) == 1:
            # one smoothed frequency at wavelength w: put the short-wavelength threshold
            # midway (log scale) between it and the next shorter one, solve for the rest
            w = float(wavelen[mid][0])
            s_mid = float((1 / f[mid][0] - 1 / factor) / (1 - 1 / factor))
            below = float(wavelen[one].max()) if one.any() else w / 2
            m = math.sqrt(below * w)
            orig = round(w * m * (1 - 1 / s_mid) / (w - m / s_mid))
            high = 1 + (orig / w - 1) / s_mid
        else:
            high = orig = float("nan")
        rope = None
        if math.isfinite(high) and math.isfinite(orig) and high > 1 and orig >= 1:
            rope = RopeConfig(
                rope_type="llama3",
                theta=theta,
                factor=factor,
                low_freq_factor=1.0,
                high_freq_factor=high,
                original_max_position_embeddings=max(1, round(orig)),
            )
            got, _ = inv_freq(rope, head_dim=head_dim, max_position_embeddings=max_pos)
            if not torch.allclose(got, want, rtol=1e-4, atol=0):
                rope = None
        if rope is None:
            raise UnsupportedModelError(
                f"{self.path}: tensor 'rope_freqs.weight' does not follow Llama 3.1 RoPE "
                "scaling; other frequency factors are not supported"
            )
        return rope

    def _auto_dtype(self) -> str:
        """``dtype="auto"``: the file's float type if its matrices are F16/BF16, else float32."""
        from gguf import GGMLQuantizationType as Q

        t = self.tensors.get("blk.0.attn_q.weight")
        kind = None if t is None else int(t.tensor_type)
        return {int(Q.F16): "float16", int(Q.BF16): "bfloat16"}.get(kind, "float32")  # type: ignore[arg-type]

    # ------------------------------------------------------------------ tensors
    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of ``name``, as bytes: ``[stop - start, row_bytes]`` uint8."""
        t = self.tensors[name]
        row_bytes = _row_bytes(t)
        begin = int(t.data_offset) + start * row_bytes
        flat = self._reader.data[begin : begin + (stop - start) * row_bytes]
        return flat.reshape(stop - start, row_bytes)


def _row_bytes(t: Any) -> int:
    """Bytes of one row (``t.shape[0]`` values: GGUF lists the innermost dimension first)."""
    from medha_runtime.model.dequant import block_shape

    per_block, block_bytes = block_shape(int(t.tensor_type))
    return int(t.shape[0]) // per_block * block_bytes


#: vocabulary-sized arrays, read only when the tokenizer is built
_BIG_ARRAYS = frozenset(f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "scores", "token_type"))


class _Keys:
    """Typed access to ``{prefix}{key}`` metadata, errors naming the file and key."""

    def __init__(self, meta: Mapping[str, Any], prefix: str, path: Path) -> None:
        self.meta, self.prefix, self.path = meta, prefix, path

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(self.prefix + key, default)

    def pos_int(self, key: str, *, default: Any = ...) -> int:
        value = self.meta.get(self.prefix + key)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.path}: metadata {self.prefix + key!r} is missing")
            return int(default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"{self.path}: metadata {self.prefix + key!r} must be a positive int, got {value!r}"
            )
        return value


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open (once per process and file version) and validate a GGUF file."""
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"GGUF file {p} does not exist")
    st = p.stat()
    return _open_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


class GGUFSource:
    """A :class:`~medha_runtime.model.loader.TensorSource` over a GGUF file.

    Tensors are served under Hugging Face names in Hugging Face layout (torch
    shape ``[out, in]``, Q/K rows in rotate-half order) as fp32; the loader
    casts them to the model dtype.

    Args:
        checkpoint: the opened file.
        config: its config (head counts for the Q/K permutation).
    """

    def __init__(self, checkpoint: GGUFCheckpoint, config: ModelConfig) -> None:
        self.ckpt = checkpoint
        self.head_dim = config.head_dim

    def _tensor(self, name: str) -> Any:
        g = gguf_name(name)
        if g is None or g not in self.ckpt.tensors:
            what = f"{g!r} (Hugging Face {name!r})" if g else repr(name)
            raise MissingTensorError(f"{self.ckpt.path}: tensor {what} is missing")
        return self.ckpt.tensors[g]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def where(self, name: str) -> str:
        return str(self.ckpt.path)

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        from medha_runtime.model.dequant import block_shape, dequantize_rows

        t = self._tensor(name)
        shape = self.shape(name)
        ggml_type = int(t.tensor_type)
        cols = shape[-1]
        rows = shape[0] if len(shape) > 1 else 1
        r0, r1 = (start, stop) if dim == 0 and len(shape) > 1 else (0, rows)
        raw = self.ckpt.raw_rows(t.name, r0, r1)
        c0, c1 = (start, stop) if dim == 1 else (0, cols)
        per_block, block_bytes = block_shape(ggml_type)
        if (c0, c1) != (0, cols) and c0 % per_block == 0 and c1 % per_block == 0:
            raw = raw[:, c0 // per_block * block_bytes : c1 // per_block * block_bytes]
            out = dequantize_rows(raw, ggml_type, c1 - c0)
        else:
            out = dequantize_rows(raw, ggml_type, cols)[:, c0:c1]
        if len(shape) == 1:
            out = out.reshape(cols)[start:stop] if dim == 0 else out.reshape(cols)
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            out = unpermute_rows(out, self.head_dim)
        return out.contiguous()


def unpermute_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation on whole heads.

    llama.cpp's converter stores each head's rows in interleaved-pair order
    (row ``2j + i`` holds Hugging Face row ``i * head_dim / 2 + j``); this maps
    them back to the rotate-half order of Hugging Face checkpoints.

    Args:
        w: ``[num_heads * head_dim, ...]`` rows of whole heads (any dtype).
        head_dim: rows per head.

    Returns:
        The same shape, rows reordered within each head.
    """
    rows = w.shape[0]
    if rows % head_dim:
        raise ValueError(f"{rows} rows are not whole heads of {head_dim}")
    rest = w.shape[1:]
    return w.reshape(rows // head_dim, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)
