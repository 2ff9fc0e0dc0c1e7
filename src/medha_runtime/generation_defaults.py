"""A model's default sampling parameters, from its ``generation_config.json``.

vLLM's ``--generation-config auto`` (its default): where a request leaves a
sampling field unset, the model's Hugging Face generation config supplies it
(Llama 3.1 Instruct ships ``temperature`` 0.6 and ``top_p`` 0.9, for
example). The fields read, and the :class:`~medha_runtime.SamplingParams`
field each sets:

- ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``: the same;
- ``max_new_tokens``: ``max_tokens`` (where a request gives none).

``do_sample`` is not read (as in vLLM): a config that sets ``temperature``
samples with it. A value equal to ``transformers``' own default
(``temperature`` 1.0, ``top_p`` 1.0, ``top_k`` 50, ``repetition_penalty``
1.0) sets nothing, as vLLM reads the file through ``GenerationConfig``'s
``to_diff_dict``: a file that states ``"top_k": 50`` leaves top-k off. A
GGUF file and the built-in ``tiny`` model carry none.

:func:`generation_defaults` resolves ``EngineConfig.generation_config``:
``"auto"`` (the model directory's file, if it has one), ``"vllm"`` (none: the
built-in defaults, vLLM's name for that), or a directory holding a
``generation_config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from medha_runtime.model.errors import ConfigError, MissingFileError
from medha_runtime.sampling_params import SamplingParams, is_number

GENERATION_CONFIG_FILE = "generation_config.json"

#: generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INTEGER_KEYS = frozenset({"top_k", "max_new_tokens"})
#: transformers' GenerationConfig defaults: a file's value equal to one sets nothing
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def generation_defaults(setting: str, model_dir: str | os.PathLike[str] | None) -> dict[str, Any]:
    """``{SamplingParams field: value}`` that ``setting`` gives.

    Args:
        setting: ``"auto"``, ``"vllm"`` or a directory (see the module docstring).
        model_dir: the model's directory (None: a model with no directory, a GGUF
            file or ``tiny``).

    Raises:
        MissingFileError: a directory ``setting`` without a generation_config.json.
        ConfigError: a file that does not parse, or a value SamplingParams refuses
            (the file and key named).
    """
    if setting == "vllm":
        return {}
    if setting == "auto":
        if model_dir is None or not Path(model_dir).is_dir():
            return {}
        file = Path(model_dir) / GENERATION_CONFIG_FILE
        return read_generation_defaults(file) if file.is_file() else {}
    file = Path(setting) / GENERATION_CONFIG_FILE
    if not file.is_file():
        raise MissingFileError(
            f"generation_config {setting!r}: no {GENERATION_CONFIG_FILE} there "
            "(give 'auto', 'vllm' or a directory holding one)"
        )
    return read_generation_defaults(file)


def read_generation_defaults(file: str | os.PathLike[str]) -> dict[str, Any]:
    """The sampling defaults one ``generation_config.json`` sets (see the module docstring)."""
    try:
        data = json.loads(Path(file).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: invalid JSON ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot be read ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    out: dict[str, Any] = {}
    for key, field in SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if not is_number(value):
            raise ConfigError(f"{file}: {key} must be a finite number, got {value!r}")
        if key in _INTEGER_KEYS and not float(value).is_integer():
            raise ConfigError(f"{file}: {key} must be a whole number, got {value!r}")
        if value == _HF_DEFAULTS.get(key):
            continue
        out[field] = int(value) if key in _INTEGER_KEYS else float(value)
        try:
            SamplingParams(**{field: out[field]})
        except ValueError as exc:
            raise ConfigError(f"{file}: {key}={value!r} is refused ({exc})") from None
    return out
