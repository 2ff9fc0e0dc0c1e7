"""medha_runtime: run Llama-family models with Medha's scheduler.

The offline API follows vLLM::

    from medha_runtime import LLM, SamplingParams

    with LLM("tiny") as llm:  # the built-in model: random weights, gibberish text
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
        print(out[0].outputs[0].text)

Pieces: :mod:`medha_runtime.model` (the Llama model, loading, the tiny
model), :mod:`medha_runtime.tokenizer`, :mod:`medha_runtime.sampling`,
:mod:`medha_runtime.engine` (scheduler loop), :mod:`medha_runtime.executor`
and :mod:`medha_runtime.runner` (workers: TP, SPP, KVP),
:mod:`medha_runtime.profile` (``medha-runtime profile``).

The names below load on first use, so that importing a torch-free part of
the package (the command line, the HTTP front end, ``bench``) does not import
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from medha_runtime.config import EngineConfig as EngineConfig
    from medha_runtime.llm import LLM as LLM
    from medha_runtime.outputs import CompletionOutput as CompletionOutput
    from medha_runtime.outputs import RequestOutput as RequestOutput
    from medha_runtime.sampling import SamplingParams as SamplingParams

_LAZY = {
    "EngineConfig": "medha_runtime.config",
    "LLM": "medha_runtime.llm",
    "CompletionOutput": "medha_runtime.outputs",
    "RequestOutput": "medha_runtime.outputs",
    "SamplingParams": "medha_runtime.sampling",
}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'medha_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
