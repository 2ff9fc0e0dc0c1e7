"""The FastAPI application: OpenAI-compatible endpoints over an :class:`EngineClient`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from medha_runtime.engine import load_model_info
from medha_runtime.sampling import SamplingParams
from medha_runtime.server.admission import AdmissionGate
from medha_runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from medha_runtime.server.client import EngineClient, EngineDeadError, Failure
from medha_runtime.server.engine_proc import AddRequest, EngineArgs, RequestDelta
from medha_runtime.server.metrics import ServerMetrics
from medha_runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from medha_runtime.tokenizer import ChatTemplateError


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, _TYPES.get(status, "BadRequestError"), status, param), status
    )


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What the HTTP side needs besides the engine.

    ``max_body_bytes``: larger request bodies get a 413 before they are read.
    ``exit_after_engine_death_s``: once the engine died, answer 503 for this
    long, then stop the server (``run_server`` exits with code 1 so a
    supervisor restarts it); None keeps answering 503.
    """

    engine: EngineArgs
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    exit_after_engine_death_s: float | None = 2.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        wait = self.exit_after_engine_death_s
        if wait is not None and not wait >= 0:
            raise ValueError(f"exit_after_engine_death_s must be >= 0 or None, got {wait}")


@dataclass
class _Sub:
    """One prompt of a request, as it runs."""

    request_id: str
    num_prompt_tokens: int
    arrival: float
    last: float | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_first: bool = False


def build_app(config: ServerConfig) -> FastAPI:
    model_path = config.engine.model
    model_name = config.served_model_name or model_path
    model_config, tokenizer = load_model_info(model_path)
    metrics = ServerMetrics(model_name)
    client = EngineClient(config.engine)
    client.on_heartbeat.append(metrics.on_heartbeat)
    admission = AdmissionGate(reject=config.engine.admission == "reject")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await client.start()
        except EngineDeadError as exc:
            # no traceback from the ASGI lifespan: stop at once, and let the runner
            # report this one line (``run_server`` raises it)
            app.state.start_error = str(exc)
            if app.state.request_exit is not None:
                app.state.request_exit()
            yield
            return
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(title="Medha OpenAI-compatible server", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.state.client = client
    app.state.metrics = metrics
    admission.install(app, client, metrics)  # 429 for requests that cannot meet their TTFT SLO
    app.state.request_exit = None  # the runner sets it: a callable that stops the server
    app.state.start_error = None  # why the engine did not start, if it did not

    def on_engine_dead(why: str) -> None:
        wait, stop = config.exit_after_engine_death_s, app.state.request_exit
        if wait is not None and stop is not None:
            asyncio.get_running_loop().call_later(wait, stop)

    client.on_dead.append(on_engine_dead)

    def max_model_len() -> int:
        return client.ready.max_model_len if client.ready else model_config.max_position_embeddings

    # ------------------------------------------------------------ errors, auth
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        if errs and errs[0].get("type") == "json_invalid":
            e = errs[0]
            why = (e.get("ctx") or {}).get("error", "decode error")
            at = e.get("loc", ("body", "?"))[-1]
            return _error(f"the request body is not valid JSON: {why} (at character {at})", 400)
        param = None
        parts = []
        for e in errs[:5]:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            if param is None and loc:
                param = loc[0]
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        return _error("; ".join(parts) or "invalid request", 400, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.message, exc.status, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):
            return _error(f"the request body is not valid UTF-8: {exc.__cause__}", 400)
        return _error(str(exc.detail), exc.status_code)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        key = config.api_key
        if (
            key is not None
            and request.url.path.startswith("/v1")
            and request.headers.get("authorization", "") != f"Bearer {key}"
        ):
            return _error("Unauthorized: missing or wrong API key", 401)
        return await call_next(request)

    # ---------------------------------------------------------------- helpers
    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_name, model_path):
            raise APIError(f"The model `{name}` does not exist.", 404, "model")

    def check_alive() -> None:
        if client.dead is not None or client.ready is None:
            raise APIError(f"the engine is not available: {client.dead}", 503)

    def need_tokenizer() -> Any:
        if tokenizer is None:
            raise APIError(f"model {model_name!r} has no tokenizer: pass prompts as token ids")
        return tokenizer

    def chat_ids(messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        tok = need_tokenizer()
        conv = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(
                    str(p.get("text", "")) for p in content if p.get("type", "text") == "text"
                )
            conv.append({"role": m.role, "content": content or ""})
        try:
            return list(
                tok.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, tokenize=True
                )
            )
        except ChatTemplateError as exc:
            raise APIError(str(exc), 400, "messages") from None

    def check_lengths(n: int, max_tokens: int | None) -> None:
        limit = max_model_len()
        if n >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {n} input tokens. Please reduce the length of the input messages.",
                400,
                "input_tokens",
            )
        if max_tokens is not None and n + max_tokens > limit:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has {n} "
                f"input tokens ({max_tokens} > {limit} - {n}).",
                400,
                "max_tokens",
            )

    def sampling(body: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if body.n != 1:
            raise APIError("only n=1 is supported", 400, "n")
        stop = body.stop
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                seed=body.seed,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                stop=() if stop is None else stop,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise APIError(str(exc), 400) from None

    def token_str(t: int) -> str:
        if tokenizer is None:
            return f"token_id:{t}"
        return tokenizer.decode([t], skip_special_tokens=False)

    def record(sub: _Sub, delta: RequestDelta, now: float) -> None:
        k = len(delta.new_token_ids)
        if k:
            if sub.last is None:
                metrics.ttft.observe(now - sub.arrival)
                if k > 1:
                    for _ in range(k - 1):
                        metrics.itl.observe(0.0)
            else:
                gap = (now - sub.last) / k
                for _ in range(k):
                    metrics.itl.observe(gap)
            sub.last = now
            metrics.generation_tokens.inc(k)
        if delta.deadline_met is True:
            metrics.deadline_met.inc()
        elif delta.deadline_met is False:
            metrics.deadline_missed.inc()
        sub.tokens.extend(delta.new_token_ids)
        sub.text += delta.new_text
        if delta.logprobs:
            sub.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            sub.finish_reason, sub.stop_reason = delta.finish_reason, delta.stop_reason
            metrics.e2e.observe(now - sub.arrival)
            metrics.prompt_tokens.inc(sub.num_prompt_tokens)
            if delta.finish_reason in metrics.success:
                metrics.success[delta.finish_reason].inc()

    async def submit(
        body: Any, prompts: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> tuple[list[_Sub], asyncio.Queue[Any]]:
        check_alive()
        admission.check(body.ttft_slo_ms, [len(ids) for _, ids in prompts])
        queue: asyncio.Queue[Any] = asyncio.Queue()
        base = uuid.uuid4().hex
        subs = []
        now = time.monotonic()
        for i, (text, ids) in enumerate(prompts):
            rid = f"{base}-{i}"
            subs.append(_Sub(rid, len(ids), now))
            msg = AddRequest(
                rid,
                ids,
                params,
                prompt=text,
                ttft_slo_s=None if body.ttft_slo_ms is None else body.ttft_slo_ms / 1e3,
                tpot_slo_s=None if body.tpot_slo_ms is None else body.tpot_slo_ms / 1e3,
                priority=body.priority,
            )
            try:
                await client.add(msg, queue, i)
            except Exception as exc:
                abort_all(subs)
                raise APIError(f"the engine is not available: {exc}", 503) from None
        return subs, queue

    def abort_all(subs: list[_Sub]) -> None:
        for s in subs:
            if s.finish_reason is None:
                task = asyncio.get_running_loop().create_task(client.abort(s.request_id))
                _background.add(task)
                task.add_done_callback(_background.discard)

    _background: set[asyncio.Task[Any]] = set()

    async def collect(request: Request, subs: list[_Sub], queue: asyncio.Queue[Any]) -> None:
        """Wait until every sub-request finished; abort them if the client goes away."""
        left = len(subs)
        try:
            while left:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if isinstance(item, Failure):
                    raise APIError(item.message, 400 if item.bad_request else 503)
                idx, delta, now = item
                record(subs[idx], delta, now)
                if delta.error is not None:  # the engine failed the step: unavailable
                    raise APIError(delta.error, 503)
                if delta.finish_reason is not None:
                    left -= 1
        finally:
            abort_all(subs)

    def usage(subs: list[_Sub]) -> dict[str, int]:
        p = sum(s.num_prompt_tokens for s in subs)
        c = sum(len(s.tokens) for s in subs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def completion_logprobs(sub: _Sub, entries: list[dict[int, float]], offset: int) -> Any:
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset
        for tok, e in zip(sub.tokens[-len(entries) :] if entries else [], entries, strict=False):
            s = token_str(tok)
            tokens.append(s)
            lps.append(e.get(tok))
            tops.append({token_str(t): lp for t, lp in e.items()})
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(toks: list[int], entries: list[dict[int, float]], top: int) -> Any:
        content = []
        for tok, e in zip(toks, entries, strict=False):
            s = token_str(tok)
            alts = sorted(e.items(), key=lambda kv: -kv[1])[:top]
            content.append(
                {
                    "token": s,
                    "logprob": e.get(tok),
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": token_str(t), "logprob": lp, "bytes": list(token_str(t).encode())}
                        for t, lp in alts
                    ],
                }
            )
        return {"content": content}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream(
        subs: list[_Sub],
        queue: asyncio.Queue[Any],
        chat: bool,
        rid: str,
        include_usage: bool,
        body: Any,
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name}
        left = len(subs)
        try:
            while left:
                item = await queue.get()
                if isinstance(item, Failure):
                    code = 400 if item.bad_request else 503
                    yield sse(error_body(item.message, _TYPES[code], code))
                    break
                idx, delta, now = item
                sub = subs[idx]
                before = len(sub.tokens)
                record(sub, delta, now)
                if delta.error is not None:  # the engine failed the step: unavailable
                    yield sse(error_body(delta.error, _TYPES[503], 503))
                    break
                if delta.finish_reason is not None:
                    left -= 1
                if not delta.new_token_ids and not delta.new_text and delta.finish_reason is None:
                    continue  # a prefill chunk: nothing generated yet
                # a token whose text is held back (part of a character, or of a possible
                # stop string) still gets a chunk, with empty text, as vLLM sends it:
                # streaming clients see the first token when it is made
                choice: dict[str, Any]
                if chat:
                    d: dict[str, Any] = {}
                    if not sub.sent_first:
                        d["role"] = "assistant"
                    d["content"] = delta.new_text
                    choice = {"index": idx, "delta": d, "logprobs": None, "finish_reason": None}
                    if body.logprobs and delta.logprobs:
                        choice["logprobs"] = chat_logprobs(
                            sub.tokens[before:], delta.logprobs, body.top_logprobs or 0
                        )
                else:
                    choice = {"index": idx, "text": delta.new_text, "logprobs": None}
                    choice["finish_reason"] = None
                    if body.logprobs is not None and delta.logprobs:
                        choice["logprobs"] = completion_logprobs(
                            sub, delta.logprobs, len(sub.text) - len(delta.new_text)
                        )
                sub.sent_first = True
                if delta.finish_reason is not None:
                    choice["finish_reason"] = delta.finish_reason
                    choice["stop_reason"] = delta.stop_reason
                yield sse({**base, "choices": [choice]})
            else:
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(subs)})
            yield "data: [DONE]\n\n"
        finally:
            abort_all(subs)

    async def run(
        request: Request,
        body: Any,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        chat: bool,
    ) -> Any:
        subs, queue = await submit(body, prompts, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + subs[0].request_id.rsplit("-", 1)[0]
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                stream(subs, queue, chat, rid, include, body),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        await collect(request, subs, queue)
        choices = []
        for i, s in enumerate(subs):
            if chat:
                c: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": s.text},
                    "logprobs": None,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                }
                if body.logprobs:
                    c["logprobs"] = chat_logprobs(s.tokens, s.logprobs, body.top_logprobs or 0)
            else:
                c = {
                    "index": i,
                    "text": s.text,
                    "logprobs": None,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                }
                if body.logprobs is not None:
                    c["logprobs"] = completion_logprobs(s, s.logprobs, 0)
            choices.append(c)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": usage(subs),
        }

    # -------------------------------------------------------------- endpoints
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        p = body.prompt
        if isinstance(p, str):
            raw: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            raw = [list(p)]
        else:
            raw = list(p)
        if not raw:
            raise APIError("prompt must not be empty", 400, "prompt")
        prompts: list[tuple[str | None, list[int]]] = []
        for x in raw:
            if isinstance(x, str):
                if not x:
                    raise APIError("the prompt is an empty string", 400, "prompt")
                prompts.append((x, need_tokenizer().encode(x)))
            else:
                prompts.append((None, list(x)))
        for _, ids in prompts:
            if not ids:
                raise APIError("the prompt is empty: it needs at least one token", 400, "prompt")
            check_lengths(len(ids), body.max_tokens)
        if body.echo:
            raise APIError("echo is not supported", 400, "echo")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = sampling(body, max_tokens, body.logprobs)
        return await run(request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        ids = chat_ids(body.messages, body.add_generation_prompt)
        mt = body.max_completion_tokens
        if mt is None:
            mt = body.max_tokens
        check_lengths(len(ids), mt)
        max_tokens = max_model_len() - len(ids) if mt is None else mt
        lp = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, max_tokens, lp)
        return await run(request, body, [(None, ids)], params, chat=True)

    @app.get("/v1/models")
    async def models() -> Any:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "medha",
                    "root": model_path,
                    "parent": None,
                    "max_model_len": max_model_len(),
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if client.dead is not None or client.ready is None:
            return _error(f"the engine is dead: {client.dead}", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, "prompt")
        if body.messages is not None:
            ids = chat_ids(body.messages, body.add_generation_prompt)
        else:
            ids = need_tokenizer().encode(
                body.prompt or "", add_special_tokens=body.add_special_tokens
            )
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len(), "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [token_str(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        check_model(body.model)
        vocab = model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", 400)
        return {"prompt": need_tokenizer().decode(body.tokens)}

    with contextlib.suppress(Exception):
        app.state.model_name = model_name
    return app
