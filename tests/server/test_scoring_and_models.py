"""Scoring a prompt (``echo`` with ``max_tokens: 0``), retrieving a model, 405's ``Allow``.

lm-evaluation-harness scores a prompt through ``/v1/completions`` with ``echo``,
``max_tokens: 0`` and ``logprobs``: the answer is the prompt with its logprobs and
nothing generated, as OpenAI and vLLM give it.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import Server
from tests.server.conftest import openai_client as client

SCORE = {"model": "tiny", "prompt": "hi there", "max_tokens": 0, "echo": True, "logprobs": 1}


def test_echo_with_max_tokens_0_scores_the_prompt(server: Server) -> None:
    r = client(server).completions.create(**SCORE)
    ch = r.choices[0]
    assert ch.text == "hi there"
    assert ch.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens >= 2
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.prompt_tokens  # prompt only
    assert lp.token_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    # the BOS token is not in the text: it adds no character (it counted 3, "<s>")
    assert lp.tokens[0] == "<s>" and lp.text_offset[:2] == [0, 0]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(ch.text)
    # the same logprobs as a request that generates (its prompt part)
    more = client(server).completions.create(**{**SCORE, "max_tokens": 2, "temperature": 0})
    assert more.choices[0].logprobs.token_logprobs[: len(lp.tokens)] == lp.token_logprobs


def test_echo_with_max_tokens_0_streamed(server: Server) -> None:
    body = {**SCORE, "stream": True, "stream_options": {"include_usage": True}}
    chunks = list(client(server).completions.create(**body))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "hi there"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert len(tokens) == chunks[-1].usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 0


def test_max_tokens_0_without_echo_is_a_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert "max_tokens" in str(info.value)
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers,
        json={"prompt": "hi", "max_tokens": 0, "echo": False},
    )
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "max_tokens"
    # scoring generates nothing: min_tokens is refused as sent (it named max_tokens=1)
    r = httpx.post(
        f"{server.url}/v1/completions", headers=server.headers, json={**SCORE, "min_tokens": 2}
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens"
    assert "max_tokens=0" in err["message"], err


def test_retrieve_model_is_the_listed_one(server: Server) -> None:
    c = client(server)
    listed = c.models.list().data[0]
    got = c.models.retrieve("tiny")
    assert got.model_dump() == listed.model_dump()
    r = httpx.get(f"{server.url}/v1/models/tiny", headers=server.headers)
    assert r.status_code == 200 and r.json()["max_model_len"] == 256


def test_retrieve_unknown_model_is_an_openai_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("gpt-4o")
    r = httpx.get(f"{server.url}/v1/models/org/other-model", headers=server.headers)
    assert r.status_code == 404
    err = r.json()["error"]
    assert "org/other-model" in err["message"] and err["code"] == 404
    assert err["param"] == "model"
    # the API key guards it as it guards the list
    assert httpx.get(f"{server.url}/v1/models/tiny").status_code == 401


def test_405_names_the_allowed_methods(server: Server) -> None:
    r = httpx.get(f"{server.url}/v1/completions", headers=server.headers)
    assert r.status_code == 405
    assert r.headers.get("allow") == "POST"
    assert r.json()["error"]["code"] == 405
