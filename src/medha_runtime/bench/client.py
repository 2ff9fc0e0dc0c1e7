"""One streaming ``POST /v1/completions`` over httpx, timed chunk by chunk.

TTFT is the time from sending to the first chunk with a choice, text or not
(a token whose text is held back still arrives as a chunk with empty text),
as vLLM's benchmark counts it; each later chunk with a choice adds an
inter-token latency. With ``stream_options.include_usage``
the server's final usage chunk gives exact token counts; without it the
content chunks are counted. Every failure (HTTP status, an error event, a
broken or unfinished stream, a timeout) is recorded with the server's message.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from medha_runtime.bench.prompts import PreparedRequest
from medha_runtime.bench.record import RequestRecord


def request_body(req: PreparedRequest, base: dict[str, Any], *, slo_fields: bool) -> dict[str, Any]:
    """``base`` (model, stream, ...) plus this request's prompt, ``max_tokens`` and SLO fields."""
    body = {**base, "prompt": req.prompt, "max_tokens": req.max_tokens}
    if slo_fields:
        if req.ttft_slo_s is not None:
            body["ttft_slo_ms"] = req.ttft_slo_s * 1e3
        if req.tpot_slo_s is not None:
            body["tpot_slo_ms"] = req.tpot_slo_s * 1e3
        if req.priority:
            body["priority"] = req.priority
    return body


async def send(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord
) -> RequestRecord:
    """Stream one completion into ``record`` (which it also returns)."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {_message(await resp.aread())}"
                return record
            await _read_stream(resp, record, start)
    except httpx.TimeoutException as exc:
        record.error = f"{type(exc).__name__}: no answer within {client.timeout.read} s"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _read_stream(resp: httpx.Response, record: RequestRecord, start: float) -> None:
    state = _Stream(start)
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            state.done = True
            break
        try:
            state.chunk(json.loads(data), record)
        except (ValueError, TypeError, AttributeError) as exc:
            record.error = f"bad chunk from the server ({exc}): {data[:200]}"
        if record.error is not None:
            return
    state.finish(record, time.perf_counter())


class _Stream:
    """Timing state of one stream."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.first_choice: float | None = None
        self.last: float | None = None
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.done = False

    def chunk(self, obj: dict[str, Any], record: RequestRecord) -> None:
        now = time.perf_counter()
        if obj.get("error"):
            record.error = f"error event: {_error_text(obj)}"
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
            if not _text(choice) and self.first_choice is not None:
                return  # a bare finish chunk carries no token
        if self.first_choice is None:
            self.first_choice = now
            record.ttft_s = now - self.start
        else:
            record.itl_s.append(now - self.last)
        self.last = now
        self.chunks += 1

    def finish(self, record: RequestRecord, now: float) -> None:
        if not self.done:
            record.error = "the stream ended without 'data: [DONE]'"
            return
        record.e2e_s = now - self.start
        if self.usage is not None:
            record.output_tokens = int(self.usage.get("completion_tokens") or 0)
            record.prompt_tokens = int(self.usage.get("prompt_tokens") or record.prompt_tokens)
        else:
            record.output_tokens = self.chunks
        if record.output_tokens < 1 or record.ttft_s is None:
            record.error = "the server generated no tokens"
        elif record.output_tokens > 1:
            record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def _text(choice: dict[str, Any]) -> str:
    """Generated text of a completion (``text``) or chat (``delta.content``) choice."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if isinstance(err, str):
        return err
    return str(obj.get("message") or obj)


def _message(raw: bytes) -> str:
    """The server's error message from an OpenAI-style (or any) error body."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(obj, dict):
        if "error" in obj:
            return _error_text(obj)
        if "detail" in obj:  # FastAPI's default
            return str(obj["detail"])
    return text[:500]
