"""Loading a Llama model: a Hugging Face directory, a GGUF file, or the built-in ``tiny``.

Model names are resolved by :mod:`medha_runtime.model.names`; GGUF files are
read by :mod:`medha_runtime.model.gguf` into the same weight plan.

``random:CONFIG`` builds a model of CONFIG's shape with random weights drawn
on the device (:mod:`medha_runtime.model.random_weights`): no weight files.

A directory holds ``config.json`` and safetensors weights: one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
Each rank reads only the tensors of its SPP stage and only its TP slice of
them (safetensors slices are read without loading the whole tensor). Q/K/V
and gate/up are fused per rank at load time; the embedding and LM head are
split over a vocabulary padded to a multiple of the TP degree.

Every failure names the file and, where there is one, the tensor:
:class:`~medha_runtime.model.errors.MissingFileError`,
:class:`~medha_runtime.model.errors.MissingTensorError`,
:class:`~medha_runtime.model.errors.ShapeMismatchError`,
:class:`~medha_runtime.model.errors.UnsupportedModelError`,
:class:`~medha_runtime.model.errors.ConfigError`,
:class:`~medha_runtime.model.errors.CorruptFileError` (a truncated or damaged
safetensors file).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from medha_parallel import TPCommunicator
from medha_runtime import huge_pages
from medha_runtime.model.config import ModelConfig
from medha_runtime.model.errors import (
    ConfigError,
    CorruptFileError,
    MissingFileError,
    MissingTensorError,
    ShapeMismatchError,
    UnsupportedModelError,
)
from medha_runtime.model.llama import LlamaModel
from medha_runtime.model.names import resolve_model

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TensorSource(Protocol):
    """Where full (unsharded) checkpoint tensors come from, by Hugging Face name."""

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape; raises :class:`MissingTensorError` naming the tensor."""
        ...

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """``tensor[..., start:stop, ...]`` along ``dim`` (the whole tensor if ``dim`` is None)."""
        ...

    def where(self, name: str) -> str:
        """The file to name in errors about ``name``."""
        ...


class DictSource:
    """Tensors held in memory (the built-in tiny model).

    Parameters loaded from it may share memory with these tensors.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, label: str = "<memory>") -> None:
        self.tensors, self.label = tensors, label

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.tensors:
            raise MissingTensorError(f"{self.label}: tensor {name!r} is missing")
        return tuple(self.tensors[name].shape)

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    def where(self, name: str) -> str:
        return self.label


class SafetensorsSource:
    """Safetensors weights of a directory, single-file or sharded with an index."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        index = directory / INDEX_FILE
        single = directory / SINGLE_FILE
        self.weight_map: dict[str, Path] = {}
        if index.is_file():
            self.label = str(index)
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise ConfigError(f"{index}: not a safetensors index ({exc!r})") from None
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()
            ):
                raise ConfigError(
                    f"{index}: not a safetensors index (weight_map must map tensor names "
                    f"to shard file names, got {json.dumps(weight_map)[:80]})"
                )
            missing: dict[str, str] = {}
            for name, file in weight_map.items():
                path = directory / file
                if not path.is_file():
                    missing.setdefault(file, name)
                self.weight_map[name] = path
            if missing:
                listing = ", ".join(f"{f} (holds {n})" for f, n in sorted(missing.items()))
                raise MissingFileError(f"{index} lists shard files that do not exist: {listing}")
        elif single.is_file():
            self.label = str(single)
            with _open_safetensors(safe_open, single) as f:
                self.weight_map = dict.fromkeys(f.keys(), single)
        else:
            others = sorted(p.name for p in directory.glob("*.bin")) + sorted(
                p.name for p in directory.glob("*.pt*")
            )
            hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
            raise MissingFileError(
                f"{directory}: no weights: expected {SINGLE_FILE} or {INDEX_FILE}{hint}"
            )
        self._handles: dict[Path, Any] = {}
        self._held: dict[Path, set[str]] = {}  # the tensor names each opened file holds

    def _file(self, name: str) -> Any:
        path = self.weight_map.get(name)
        if path is None:
            raise MissingTensorError(f"{self.label}: tensor {name!r} is missing")
        if path not in self._handles:
            self._handles[path] = _open_safetensors(self._safe_open, path)
            self._held[path] = set(self._handles[path].keys())
        f = self._handles[path]
        if name not in self._held[path]:  # an index naming the wrong shard for the tensor
            raise MissingTensorError(
                f"{self.label}: tensor {name!r} is listed in {path.name}, which does not hold it"
            )
        return f

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        f = self._file(name)
        if dim is None:
            return f.get_tensor(name)
        index = (slice(None),) * dim + (slice(start, stop),)
        return f.get_slice(name)[index]

    def where(self, name: str) -> str:
        path = self.weight_map.get(name)
        return str(path) if path is not None else self.label


def _open_safetensors(safe_open: Any, path: Path) -> Any:
    """``safe_open(path)``; a damaged file is a :class:`CorruptFileError` naming it."""
    from safetensors import SafetensorError

    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CorruptFileError(
            f"{path}: not a readable safetensors file, truncated or damaged ({exc})"
        ) from None


@dataclass(frozen=True)
class Piece:
    """A slice ``[start, stop)`` along ``dim`` of checkpoint tensor ``name``.

    ``stop`` may pass the tensor's end (vocabulary padding): the rest is zeros.
    """

    name: str
    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0


def weight_plan(model: LlamaModel) -> dict[str, list[Piece]]:
    """For each of the model's parameter names, the checkpoint slices it is built from.

    Several pieces (fused q/k/v, gate/up) are concatenated along dim 0.
    """
    c = model.config
    tp, rank = model.tp.world_size, model.tp.rank
    hidden, d = c.hidden_size, c.head_dim

    def rows(name: str, shape: tuple[int, ...]) -> Piece:
        per = shape[0] // tp
        return Piece(name, shape, 0, rank * per, (rank + 1) * per)

    def cols(name: str, shape: tuple[int, ...]) -> Piece:
        per = shape[1] // tp
        return Piece(name, shape, 1, rank * per, (rank + 1) * per)

    def vocab(name: str) -> Piece:
        per = -(-c.vocab_size // tp)
        return Piece(name, (c.vocab_size, hidden), 0, rank * per, (rank + 1) * per)

    plan: dict[str, list[Piece]] = {}
    if model.is_first:
        plan["embed_tokens.weight"] = [vocab("model.embed_tokens.weight")]
    q, kv = (c.num_q_heads * d,), (c.num_kv_heads * d,)
    for i in model.layer_range:
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        a = src + "self_attn."
        plan[dst + "self_attn.qkv_proj.weight"] = [
            rows(a + "q_proj.weight", (q[0], hidden)),
            rows(a + "k_proj.weight", (kv[0], hidden)),
            rows(a + "v_proj.weight", (kv[0], hidden)),
        ]
        plan[dst + "self_attn.o_proj.weight"] = [cols(a + "o_proj.weight", (hidden, q[0]))]
        if c.attention_bias:
            plan[dst + "self_attn.qkv_proj.bias"] = [
                rows(a + "q_proj.bias", q),
                rows(a + "k_proj.bias", kv),
                rows(a + "v_proj.bias", kv),
            ]
            plan[dst + "self_attn.o_proj.bias"] = [Piece(a + "o_proj.bias", (hidden,))]
        m, ffn = src + "mlp.", c.intermediate_size
        plan[dst + "mlp.gate_up_proj.weight"] = [
            rows(m + "gate_proj.weight", (ffn, hidden)),
            rows(m + "up_proj.weight", (ffn, hidden)),
        ]
        plan[dst + "mlp.down_proj.weight"] = [cols(m + "down_proj.weight", (hidden, ffn))]
        if c.mlp_bias:
            plan[dst + "mlp.gate_up_proj.bias"] = [
                rows(m + "gate_proj.bias", (ffn,)),
                rows(m + "up_proj.bias", (ffn,)),
            ]
            plan[dst + "mlp.down_proj.bias"] = [Piece(m + "down_proj.bias", (hidden,))]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plan[f"{dst}{norm}.weight"] = [Piece(f"{src}{norm}.weight", (hidden,))]
    if model.is_last:
        plan["norm.weight"] = [Piece("model.norm.weight", (hidden,))]
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        plan["lm_head.weight"] = [vocab(head)]
    return plan


def load_weights(
    model: LlamaModel, source: TensorSource, *, device: torch.device | str = "cpu"
) -> LlamaModel:
    """Fill ``model`` (typically built on ``"meta"``) with this rank's slices from ``source``.

    Raises:
        MissingTensorError: a tensor the stage needs is absent (named, with its file).
        ShapeMismatchError: a tensor's shape differs from the config's (named,
            expected vs got).
    """
    plan = weight_plan(model)
    arena = None
    if torch.device(device).type == "cpu":  # every weight on huge pages where the kernel allows
        shapes = {tuple(pieces): _param_shape(pieces) for pieces in plan.values()}
        arena = huge_pages.new_arena(
            huge_pages.packed_bytes([(shape, model.dtype) for shape in shapes.values()])
        )
    made: dict[tuple[Piece, ...], nn.Parameter] = {}
    state: dict[str, nn.Parameter] = {}
    for param_name, pieces in plan.items():
        key = tuple(pieces)
        if key not in made:
            parts = [_read_piece(source, p, model.dtype, device) for p in pieces]
            if arena is None:
                value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            elif len(parts) == 1:
                value = arena.copy(parts[0])
            else:  # fused pieces straight into the arena: no concatenated temporary
                value = torch.cat(parts, dim=0, out=arena.empty(shapes[key], model.dtype))
            made[key] = nn.Parameter(value, requires_grad=False)
        state[param_name] = made[key]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model


def _param_shape(pieces: list[Piece]) -> tuple[int, ...]:
    """The shape of a parameter built from ``pieces`` (sliced, padded, concatenated on dim 0)."""
    shapes = []
    for p in pieces:
        shape = list(p.shape)
        if p.dim is not None:
            shape[p.dim] = p.stop - p.start
        shapes.append(shape)
    return (sum(s[0] for s in shapes), *shapes[0][1:]) if shapes[0] else ()


def _read_piece(
    source: TensorSource, piece: Piece, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    got = source.shape(piece.name)
    if got != piece.shape:
        raise ShapeMismatchError(
            f"{source.where(piece.name)}: tensor {piece.name!r} has shape {list(got)}, "
            f"expected {list(piece.shape)} from the config"
        )
    if piece.dim is None:
        t = source.read(piece.name, None, 0, 0)
    else:
        stop = min(piece.stop, got[piece.dim])
        t = source.read(piece.name, piece.dim, piece.start, max(stop, piece.start))
        short = piece.stop - piece.start - t.shape[piece.dim]
        if short > 0:  # vocabulary padding
            pad_shape = list(t.shape)
            pad_shape[piece.dim] = short
            t = torch.cat([t, t.new_zeros(pad_shape)], dim=piece.dim)
    if not t.is_floating_point():  # cast to float, integer codes would be garbage weights
        raise UnsupportedModelError(
            f"{source.where(piece.name)}: tensor {piece.name!r} is stored as {t.dtype}; "
            "medha_runtime reads float weights (float32, float16, bfloat16)"
        )
    return t.to(device=device, dtype=dtype).contiguous()


def load_config(path: str | Path) -> ModelConfig:
    """The config of a model: ``config.json`` of a directory, or a GGUF file's metadata.

    ``path`` is any model name :func:`~medha_runtime.model.names.resolve_model`
    accepts (``"tiny"``, ``"smollm2"``, a hub id...).
    """
    from medha_runtime.model.random_weights import random_config_path

    model = resolve_model(path)
    if model.kind == "tiny":
        from medha_runtime.model.tiny import tiny_config

        return tiny_config()
    if model.kind == "gguf":
        from medha_runtime.model.gguf import open_gguf

        return open_gguf(model.path).config()
    file = random_config_path(model.path)
    if file is None:
        file = _model_dir(model.path) / CONFIG_FILE
    if not file.is_file():
        raise MissingFileError(
            f"{file} not found: {file.parent} is not a Hugging Face model directory"
        )
    try:
        raw = json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return ModelConfig.from_hf_dict(raw, source=str(file))


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    tp: TPCommunicator | None = None,
    layer_range: range | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """Build this rank's stage of a model.

    Args:
        path: a model name (:func:`~medha_runtime.model.names.resolve_model`):
            a local Hugging Face directory, a ``.gguf`` file (dequantized to
            ``dtype`` at load), ``"tiny"`` (the built-in model: random weights,
            gibberish output), ``"smollm2"``, a hub id in the local cache, or
            ``"random:CONFIG"`` (CONFIG's shape, random weights drawn on ``device``).
        dtype: ``"auto"`` (the config's dtype; float32 for quantized GGUF
            files), a name, or a torch dtype.
        device: where the weights go.
        tp: this rank's TP communicator (default: one rank).
        layer_range: this SPP stage's layers (default all).

    Returns:
        ``(model, config)``.
    """
    model_name = resolve_model(path)
    if model_name.kind == "tiny":
        from medha_runtime.model.tiny import build_tiny

        return build_tiny(dtype=dtype, device=device, tp=tp, layer_range=layer_range)
    from medha_runtime.model.random_weights import RandomSource, checkpoint_shapes

    source: TensorSource
    if model_name.kind == "gguf":
        from medha_runtime.model.gguf import GGUFSource, open_gguf

        checkpoint = open_gguf(model_name.path)
        config = checkpoint.config()
        source = GGUFSource(checkpoint, config)
        model = LlamaModel(config, dtype=dtype, device="meta", tp=tp, layer_range=layer_range)
    else:
        config = load_config(model_name.path)
        model = LlamaModel(config, dtype=dtype, device="meta", tp=tp, layer_range=layer_range)
        if model_name.kind == "random":
            shapes = checkpoint_shapes(config)
            source = RandomSource(shapes, device=device, dtype=model.dtype, label=str(path))
        else:
            source = SafetensorsSource(_model_dir(model_name.path))
    load_weights(model, source, device=device)
    return model, config


def _model_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.exists():
        raise MissingFileError(f"model directory {directory} does not exist")
    if not directory.is_dir():
        raise MissingFileError(f"{directory} is not a directory")
    return directory
