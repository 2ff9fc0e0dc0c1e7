"""Refuse request bodies over a size limit (413) without reading them into memory.

A pure ASGI middleware: a ``Content-Length`` over the limit is answered at
once, before any of the body is read; a body without one (chunked) is
counted as it arrives and refused as soon as it passes the limit, so the
server never holds more than the limit plus one chunk.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from medha_runtime.server.protocol import error_body

#: default limit: far above any prompt the context limit allows, far below a memory risk
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def too_large_message(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes"


class BodyLimit:
    def __init__(self, app: Any, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            body = error_body(too_large_message(self.max_bytes), "BadRequestError", 413)
            await JSONResponse(body, 413, headers={"Connection": "close"})(scope, receive, send)
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Any) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
