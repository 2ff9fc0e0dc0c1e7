"""``medha-runtime serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

The HTTP process never runs the model and imports no torch: a separate
engine process owns the :class:`~medha_runtime.engine.LLMEngine` (and its
workers) and talks to the HTTP process over ZeroMQ (see
:mod:`medha_runtime.server.engine_proc` and :mod:`medha_runtime.server.messages`).

The names below load on first use, so that the start-up checks
(:mod:`medha_runtime.server.startup`) run before FastAPI and uvicorn import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from medha_runtime.server.engine_proc import EngineArgs as EngineArgs
    from medha_runtime.server.main import run_server as run_server

_LAZY = {
    "EngineArgs": "medha_runtime.server.engine_proc",
    "run_server": "medha_runtime.server.main",
}

__all__ = ["EngineArgs", "run_server"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'medha_runtime.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
