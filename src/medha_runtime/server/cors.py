"""Cross-origin requests (CORS), as ``vllm serve``'s ``--allowed-origins`` and kin.

:class:`CorsConfig` holds what ``serve``'s flags give (each list a JSON list
on the command line, read by :func:`json_str_list`); :func:`install` answers
browsers' preflight ``OPTIONS`` requests and adds ``Access-Control-*``
headers with Starlette's ``CORSMiddleware``. An origin that is not allowed
gets no ``Access-Control-Allow-Origin`` header (the browser then hides the
response from the page). Imports nothing heavy: the command line reads its
flags with it before the server starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ANY = ("*",)


@dataclass(frozen=True, kw_only=True)
class CorsConfig:
    """Origins, methods and request headers allowed cross-origin (``"*"``: any), and
    whether the browser may send credentials (cookies, ``Authorization``) with them.
    The defaults are vLLM's: any origin, method and header, no credentials."""

    allowed_origins: tuple[str, ...] = ANY
    allowed_methods: tuple[str, ...] = ANY
    allowed_headers: tuple[str, ...] = ANY
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a tuple of strings, got {value!r}")
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(f"allow_credentials must be a bool, got {self.allow_credentials!r}")


def json_str_list(text: str) -> tuple[str, ...]:
    """``'["https://a.example", "https://b.example"]'`` as a tuple; ValueError (one
    line, naming the text) for bad JSON or anything but a list of strings."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"expected a JSON list of strings, got {text!r} ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return tuple(value)


def install(app: Any, cors: CorsConfig) -> None:
    """Add the CORS middleware to a FastAPI ``app`` (outside the API-key check, so
    that a preflight needs no key and an error response carries the headers too)."""
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(cors.allowed_origins),
        allow_methods=list(cors.allowed_methods),
        allow_headers=list(cors.allowed_headers),
        allow_credentials=cors.allow_credentials,
    )
