"""``cache_salt`` on the server (vLLM's field): a salted request hits only the
prefix-cache blocks of requests with the same salt."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import Server

from .test_server import client, post

openai = pytest.importorskip("openai")

DOC = "cache salt test: " + " ".join(f"w{i}" for i in range(20))
KW = {"model": "tiny", "max_tokens": 3, "temperature": 0}


def _cached(server: Server, salt: str | None, tail: str, chat: bool) -> int:
    extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
    c = client(server)
    if chat:
        messages = [{"role": "user", "content": f"{DOC} {tail}"}]
        r = c.chat.completions.create(messages=messages, **KW, **extra)
    else:
        r = c.completions.create(prompt=f"{DOC} {tail}", **KW, **extra)
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_a_salt_shares_cached_prefixes_only_with_its_own_salt(server: Server, chat: bool) -> None:
    first = f"{'chat' if chat else 'completion'} a"
    assert _cached(server, f"{first}-a", "x", chat) == 0
    assert _cached(server, f"{first}-b", "y", chat) == 0  # another salt: nothing shared
    assert _cached(server, None, "z", chat) == 0  # no salt: not the salted blocks
    assert _cached(server, f"{first}-a", "u", chat) > 0
    assert _cached(server, f"{first}-b", "v", chat) > 0
    assert _cached(server, None, "w", chat) > 0  # unsalted requests share as before


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 7])
def test_an_empty_or_non_string_salt_is_a_400_naming_it(server: Server, path, salt) -> None:
    body: dict = {"max_tokens": 2, "cache_salt": salt}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r: httpx.Response = post(server, path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and "cache_salt" in err["message"]


def test_a_streamed_request_takes_its_salt(server: Server) -> None:
    def streamed(salt: str, tail: str) -> int:
        stream = client(server).completions.create(
            prompt=f"{DOC} stream {tail}",
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": salt},
            **KW,
        )
        return list(stream)[-1].usage.prompt_tokens_details.cached_tokens

    assert streamed("stream-a", "x") == 0
    assert streamed("stream-b", "y") == 0
    assert streamed("stream-a", "z") > 0
