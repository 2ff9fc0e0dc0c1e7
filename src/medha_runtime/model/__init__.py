"""Llama-family models over a paged KV cache: config, RoPE, model, loader.

The built-in random model lives in :mod:`medha_runtime.model.tiny`.
"""

from medha_runtime.model.batch import ForwardBatch as ForwardBatch
from medha_runtime.model.batch import KVCache as KVCache
from medha_runtime.model.config import ModelConfig as ModelConfig
from medha_runtime.model.config import RopeConfig as RopeConfig
from medha_runtime.model.errors import ConfigError as ConfigError
from medha_runtime.model.errors import CorruptFileError as CorruptFileError
from medha_runtime.model.errors import MissingFileError as MissingFileError
from medha_runtime.model.errors import MissingTensorError as MissingTensorError
from medha_runtime.model.errors import ModelLoadError as ModelLoadError
from medha_runtime.model.errors import ModelNotAvailableError as ModelNotAvailableError
from medha_runtime.model.errors import ShapeMismatchError as ShapeMismatchError
from medha_runtime.model.errors import UnsupportedModelError as UnsupportedModelError
from medha_runtime.model.llama import AttentionFn as AttentionFn
from medha_runtime.model.llama import LlamaModel as LlamaModel
from medha_runtime.model.llama import PagedAttention as PagedAttention
from medha_runtime.model.loader import load_config as load_config
from medha_runtime.model.loader import load_model as load_model
