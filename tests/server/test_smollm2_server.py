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


#: an emoji (4 bytes, over several byte-level tokens) and CJK text (3 bytes a character)
EMOJI_CJK = "Smile 😀 please: 你好世界, 日本語 ok"


def _check_offsets(text: str, offsets: list[int]) -> None:
    """OpenAI's ``text_offset``: each token's character offset into the returned text."""
    assert offsets[0] == 0
    assert offsets == sorted(offsets), offsets
    assert offsets[-1] <= len(text)
    ends = [*offsets[1:], len(text)]
    assert "".join(text[a:b] for a, b in zip(offsets, ends, strict=True)) == text


def test_smollm2_text_offsets_index_the_returned_text(smollm2_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    ask = {"model": "smollm2", "prompt": EMOJI_CJK, "temperature": 0, "logprobs": 1}
    r = client.completions.create(**ask, max_tokens=0, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == EMOJI_CJK
    _check_offsets(EMOJI_CJK, lp.text_offset)
    # " 😀" is two tokens (the space and part of the emoji's bytes, then the rest):
    # both at the offset of the space, the first adding no text of its own
    at = EMOJI_CJK.index(" 😀")
    assert lp.text_offset.count(at) == 2
    assert lp.tokens[lp.text_offset.index(at)].startswith("bytes:")
    assert EMOJI_CJK.index("你") in lp.text_offset
    assert EMOJI_CJK[lp.text_offset[-1] :] == " ok" == lp.tokens[-1]
    # echoed with generated text, streamed and not: the same offsets
    r = client.completions.create(**ask, max_tokens=12, echo=True)
    whole = r.choices[0]
    _check_offsets(whole.text, whole.logprobs.text_offset)
    assert whole.logprobs.text_offset[: len(lp.text_offset)] == lp.text_offset
    chunks = list(client.completions.create(**ask, max_tokens=12, echo=True, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert text == whole.text
    assert offsets == whole.logprobs.text_offset


def test_smollm2_text_offsets_of_generated_emoji(smollm2_server: Server) -> None:
    """Generated text with multi-byte characters (without echo, offsets start at 0)."""
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    r = client.completions.create(
        model="smollm2",
        prompt="Translate to Chinese: hello world =",
        temperature=0,
        max_tokens=16,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    ch = r.choices[0]
    _check_offsets(ch.text, ch.logprobs.text_offset)
    assert len(ch.logprobs.text_offset) == r.usage.completion_tokens
