"""The FastAPI application: OpenAI-compatible endpoints over an :class:`EngineClient`.

:func:`build_app` assembles the pieces: the engine client (started in the
app's lifespan), the endpoints (:mod:`medha_runtime.server.routes`), error
handlers that answer OpenAI error bodies, API-key, body-size and CORS middleware,
and the log (:mod:`medha_runtime.server.logs`). Nothing here imports torch:
the model's facts and its tokenizer arrive from the engine process as plain
data (:class:`~medha_runtime.server.messages.EngineReady`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from medha_runtime.server.admission import AdmissionGate
from medha_runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from medha_runtime.server.client import EngineClient, EngineDeadError, StartCancelled
from medha_runtime.server.cors import CorsConfig
from medha_runtime.server.cors import install as install_cors
from medha_runtime.server.engine_proc import EngineArgs
from medha_runtime.server.logs import StatsLogger, log_lines, logger, startup_summary
from medha_runtime.server.metrics import ServerMetrics
from medha_runtime.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from medha_runtime.server.routes import ERROR_TYPES, Frontend, off_loop, text_chars
from medha_runtime.server.tokens import FrontTokenizer
from medha_runtime.version import medha_version

__all__ = ["APIError", "ServerConfig", "build_app"]


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, ERROR_TYPES.get(status, "BadRequestError"), status, param), status
    )


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What the HTTP side needs besides the engine.

    ``served_model_name``: the only model name requests may use (default: the
    model as given). ``max_body_bytes``: larger request bodies get a 413
    before they are read. ``exit_after_engine_death_s``: once the engine
    died, answer 503 for this long, then stop the server (``run_server``
    exits with code 1 so a supervisor restarts it); None keeps answering 503.
    ``log_requests``: one access line per request. ``stats_interval_s``:
    seconds between statistics lines while busy. ``address``: shown in the
    start-up summary. ``cors``: the origins, methods and headers allowed
    cross-origin (default: any, without credentials, as vLLM).
    """

    engine: EngineArgs
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    exit_after_engine_death_s: float | None = 2.0
    log_requests: bool = True
    stats_interval_s: float = 10.0
    address: str = ""
    cors: CorsConfig = field(default_factory=CorsConfig)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        wait = self.exit_after_engine_death_s
        if wait is not None and not wait >= 0:
            raise ValueError(f"exit_after_engine_death_s must be >= 0 or None, got {wait}")
        if not self.stats_interval_s > 0:
            raise ValueError(f"stats_interval_s must be > 0, got {self.stats_interval_s}")


class APIKey:
    """ASGI middleware: ``Authorization: Bearer KEY`` on ``/v1/*`` (pure ASGI, so a
    client's disconnect still reaches the endpoints at once)."""

    def __init__(self, app: Any, *, key: str | None) -> None:
        self.app, self.expected = app, None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            self.expected is not None
            and scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and dict(scope.get("headers", ())).get(b"authorization") != self.expected
        ):
            await _error("Unauthorized: missing or wrong API key", 401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(config: ServerConfig) -> FastAPI:
    model_name = config.served_model_name or config.engine.model
    metrics = ServerMetrics(model_name)
    client = EngineClient(config.engine)
    client.on_heartbeat.append(metrics.on_heartbeat)
    stats = StatsLogger(config.stats_interval_s)
    client.on_heartbeat.append(stats.on_heartbeat)
    admission = AdmissionGate(reject=config.engine.admission == "reject")
    front = Frontend(
        client, metrics, admission, model_name=model_name, log_requests=config.log_requests
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        try:
            await client.start()
        except StartCancelled:  # SIGINT/SIGTERM during start-up: stop the engine, exit 0
            logger.info("stopped while the engine was starting")
            await client.stop(timeout_s=0.5)  # a starting engine reads no Shutdown
            yield
            return
        except EngineDeadError as exc:
            # no traceback from the ASGI lifespan: stop at once, and let the runner
            # report this one line (``run_server`` raises it)
            app.state.start_error = str(exc)
            if app.state.request_exit is not None:
                app.state.request_exit()
            yield
            return
        assert client.ready is not None
        if client.ready.tokenizer is not None:
            front.tokenizer = FrontTokenizer(client.ready.tokenizer)
        log_lines(startup_summary(client.ready, served_name=model_name, address=config.address))
        # what start-up built (modules, the tokenizer, the app) lives as long as the
        # server: out of the collector's full passes, which otherwise stall the event
        # loop, and every request on it, for ~100 ms now and then
        gc.collect()
        gc.freeze()
        stats_task = asyncio.get_running_loop().create_task(stats.run())
        try:
            yield
        except asyncio.CancelledError:
            # a second Ctrl-C while stopping: uvicorn skips the lifespan's shutdown and
            # cancels it on exit; the engine is stopped all the same (below), and
            # starlette does not log the cancellation as a traceback
            logger.info("stopping at once (second signal)")
        finally:
            stats_task.cancel()
            with contextlib.suppress(BaseException):
                await stats_task
            await client.stop()

    app = FastAPI(title="Medha OpenAI-compatible server", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(APIKey, key=config.api_key)
    install_cors(app, config.cors)
    app.state.client = client
    app.state.metrics = metrics
    app.state.front = front
    admission.install(app, client, metrics)  # 429 for requests that cannot meet their TTFT SLO
    app.state.request_exit = None  # the runner sets it: a callable that stops the server
    app.state.start_error = None  # why the engine did not start, if it did not
    app.state.model_name = model_name

    def on_engine_dead(why: str) -> None:
        wait, stop = config.exit_after_engine_death_s, app.state.request_exit
        logger.error("the engine died: %s", why)
        if wait is not None and stop is not None:
            asyncio.get_running_loop().call_later(wait, stop)

    client.on_dead.append(on_engine_dead)

    def on_signal() -> None:
        """SIGINT/SIGTERM (from the runner, in the loop): end every request now."""
        front.shutting_down = True
        client.start_cancelled = True
        ids = client.fail_all("the server is shutting down")
        if ids:
            logger.info("shutting down: aborted %d in-flight engine request(s)", len(ids))

    app.state.on_signal = on_signal

    def on_engine_stopped(signal_name: str) -> None:
        """The engine process stopped on a signal (e.g. the whole process group got
        SIGTERM): end every request and stop the server, as on our own signal."""
        logger.info("the engine process got %s: stopping the server", signal_name)
        on_signal()
        if app.state.request_exit is not None:
            app.state.request_exit()

    client.on_stopped.append(on_engine_stopped)
    _install_errors(app, front)
    _install_routes(app, front, client, metrics)
    return app


def _install_errors(app: FastAPI, front: Frontend) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        kind = request.headers.get("content-type")
        if errs and tuple(errs[0].get("loc", ())) == ("body",) and not _json_media_type(kind):
            # FastAPI >= 0.132 reads such a body as bytes, not JSON (``curl -d`` sends form
            # data's type): say so, not "body: Input should be a valid dictionary ..."; an
            # older one parses it, and a valid JSON body that is no object lands here too
            got = f"got Content-Type {kind!r}" if kind else "got no Content-Type"
            message = (
                "the request body must be a JSON object, sent with the header "
                f"'Content-Type: application/json'; {got}"
            )
            front.access_error(request.url.path, 400, message)
            return _error(message, 400)
        if errs and errs[0].get("type") == "json_invalid":
            e = errs[0]
            why = (e.get("ctx") or {}).get("error", "decode error")
            at = e.get("loc", ("body", "?"))[-1]
            message = f"the request body is not valid JSON: {why} (at character {at})"
            front.access_error(request.url.path, 400, message)
            return _error(message, 400)
        param = None
        parts = []
        for e in errs[:5]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        message = "; ".join(parts) or "invalid request"
        front.access_error(request.url.path, 400, message)
        return _error(message, 400, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if not exc.logged:
            front.access_error(request.url.path, exc.status, exc.message)
        return _error(exc.message, exc.status, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):
            return _error(f"the request body is not valid UTF-8: {exc.__cause__}", 400)
        response = _error(str(exc.detail), exc.status_code)
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110 15.5.6)
        return response


def _install_routes(
    app: FastAPI, front: Frontend, client: EngineClient, metrics: ServerMetrics
) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await front.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await front.chat_completions(body, request)

    def model_card() -> dict[str, Any]:
        ready = client.ready
        return {
            "id": front.model_name,
            "object": "model",
            "created": int(client.started_at),
            "owned_by": "medha",
            "root": ready.model if ready is not None else None,
            "parent": None,
            "max_model_len": front.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        """OpenAI's "retrieve model": the listed model, or a 404 naming the id."""
        front.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if client.dead is not None or client.ready is None:
            return _error(f"the engine is not available: {client.dead or 'starting'}", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Any:
        return {"version": medha_version()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        front.check_text(body)
        front.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, "prompt")
        if body.messages is not None:
            chars = text_chars(body.messages)
            ids = await off_loop(chars, front.chat_ids_of, body)
        else:
            tok = front.need_tokenizer()
            ids = await off_loop(
                text_chars(body.prompt or ""), tok.encode, body.prompt or "",
                body.add_special_tokens,
            )  # fmt: skip
        out: dict[str, Any] = {"count": len(ids), "max_model_len": front.max_model_len}
        out["tokens"] = ids
        if body.return_token_strs:
            out["token_strs"] = [front.token_text().text(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        front.check_text(body)
        front.check_model(body.model)
        vocab = front.vocab_size
        if vocab is not None:
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    f"tokens: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                    400,
                    "tokens",
                )
        return {"prompt": front.need_tokenizer().decode(body.tokens)}


def _json_media_type(content_type: str | None) -> bool:
    """Whether this ``Content-Type`` says JSON (FastAPI parses the body as JSON only then)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
