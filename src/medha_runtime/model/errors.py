"""Errors raised while reading a checkpoint; each message names the file or tensor."""

from __future__ import annotations


class ModelLoadError(Exception):
    """Base class: something in a model directory cannot be used."""


class MissingFileError(ModelLoadError, FileNotFoundError):
    """A required file (config.json, weights, a shard, tokenizer.json) is absent."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """The checkpoint asks for an architecture or feature medha_runtime does not run."""


class ConfigError(ModelLoadError, ValueError):
    """A config field is missing or has an invalid value."""


class MissingTensorError(ModelLoadError, LookupError):
    """A tensor the model needs is absent from the weights."""


class ShapeMismatchError(ModelLoadError, ValueError):
    """A tensor's shape differs from what the config implies."""


class CorruptFileError(ModelLoadError, ValueError):
    """A weights file is damaged: wrong magic, truncated, unreadable metadata."""


class ModelNotAvailableError(ModelLoadError, FileNotFoundError):
    """A model name that cannot be resolved here: not cached and not downloadable now."""
