"""``medha-runtime serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

The HTTP process never runs the model: a separate engine process owns the
:class:`~medha_runtime.engine.LLMEngine` (and its workers) and talks to the
HTTP process over ZeroMQ (see :mod:`medha_runtime.server.engine_proc`).
"""

from __future__ import annotations

from medha_runtime.server.engine_proc import EngineArgs
from medha_runtime.server.main import run_server

__all__ = ["EngineArgs", "run_server"]
