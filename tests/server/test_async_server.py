"""``serve --async-scheduling`` answers as the synchronous server does (tiny model)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import Server, start_server, stop_server

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    sync = start_server("--seed", "5")
    try:
        fast = start_server("--seed", "5", "--async-scheduling")
        try:
            yield sync, fast
        finally:
            stop_server(fast)
    finally:
        stop_server(sync)


def complete(server: Server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: Server, body: dict) -> tuple[str, int, str | None]:
    """Streamed text, the number of chunks with a choice, the finish reason."""
    text, chunks, reason = "", 0, None
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event["choices"]:
                chunks += 1
                text += choice["text"]
                reason = choice["finish_reason"] or reason
    return text, chunks, reason


def answers(out: dict) -> list[tuple]:
    usage = out["usage"]
    return [(c["text"], c["finish_reason"]) for c in out["choices"]] + [
        (usage["prompt_tokens"], usage["completion_tokens"])
    ]


def test_async_server_matches_the_sync_server(servers: tuple[Server, Server]) -> None:
    sync, fast = servers
    greedy = {"prompt": "hello there", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    ref = complete(sync, greedy)
    text = ref["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    bodies = [
        greedy,
        {"prompt": ["one", "two two"], "max_tokens": 9, "temperature": 0.9, "seed": 3},
        greedy | {"stop": [stop]},
        {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    ]
    for body in bodies:
        assert answers(complete(fast, body)) == answers(complete(sync, body)), body
    cut = complete(fast, greedy | {"stop": [stop]})["choices"][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["text"]


def test_async_stream_stops_without_the_extra_token(servers: tuple[Server, Server]) -> None:
    sync, fast = servers
    body = {"prompt": "stream me", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    text = complete(sync, body)["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    want = complete(sync, body | {"stop": [stop]})
    got = stream(fast, body | {"stop": [stop]})
    assert got[0] == want["choices"][0]["text"] and got[2] == "stop"
    full = stream(fast, body)
    assert full[0] == text and full[2] == "length"
    assert full[1] >= got[1]
