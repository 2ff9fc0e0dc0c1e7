"""``medha-runtime serve smollm2``: a real model answers through the OpenAI client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.conftest import Server, start_server, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2_server(smollm2_cache) -> Iterator[Server]:
    """smollm2 from the session's Medha cache, with a fixed cost model (no calibration)."""
    s = start_server(
        "--cost-model",
        "affine:base=0.01,per_token=0.0001,per_attn=0",
        "--dtype",
        "float32",
        model="smollm2",
        env={"MEDHA_CACHE_DIR": str(smollm2_cache)},
        timeout_s=240.0,
    )
    try:
        yield s
    finally:
        stop_server(s)


def test_smollm2_knows_the_capital_of_france(smollm2_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
    )
    choice = reply.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"  # <|im_end|> ends the turn


def test_smollm2_bad_words_keep_a_word_out_of_the_answer(smollm2_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    ask = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 24,
    }
    assert "Paris" in client.chat.completions.create(**ask).choices[0].message.content
    # " Paris" inside a sentence is another token than "Paris": both are banned
    reply = client.chat.completions.create(**ask, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in reply.choices[0].message.content, reply.choices[0].message.content
