"""vLLM's chat and prompt options: ``continue_final_message``, ``chat_template_kwargs``,
``truncate_prompt_tokens``; and ``/version``."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from medha_runtime.model.tiny import tiny_tokenizer
from tests.server.conftest import API_KEY, Server

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=60, max_retries=0)


def post(server: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, headers=server.headers, timeout=60)


def test_continue_final_message_prompt_ends_in_its_content(server: Server) -> None:
    body = {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True}
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    want = tiny_tokenizer().apply_chat_template(
        MESSAGES, add_generation_prompt=False, continue_final_message=True, tokenize=True
    )
    assert r.json()["tokens"] == want
    out = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        temperature=0.0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert out.usage.prompt_tokens == len(want)
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2,
            extra_body={"continue_final_message": True},
        )  # fmt: skip
    assert err.value.body["param"] == "continue_final_message"
    assert "add_generation_prompt=false" in err.value.body["message"]


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(
    server: Server,
) -> None:
    plain = post(server, "/tokenize", {"messages": MESSAGES[:1]}).json()["tokens"]
    body = {"messages": MESSAGES[:1], "chat_template_kwargs": {"unused_variable": 1}}
    assert post(server, "/tokenize", body).json()["tokens"] == plain
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(
            model="tiny", messages=MESSAGES[:1], max_tokens=1,
            extra_body={"chat_template_kwargs": {"messages": []}},
        )  # fmt: skip
    assert err.value.body["param"] == "chat_template_kwargs"
    assert "'messages'" in err.value.body["message"]


def test_truncate_prompt_tokens_keeps_the_last_k(server: Server) -> None:
    c = client(server)
    ids = list(range(10, 40))
    greedy = {"model": "tiny", "max_tokens": 3, "temperature": 0.0}
    cut = c.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 5}, **greedy)
    tail = c.completions.create(prompt=ids[-5:], **greedy)
    assert cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == tail.choices[0].text
    extra = {"truncate_prompt_tokens": 5, "return_tokens_as_token_ids": True}
    echo = c.completions.create(prompt=ids, echo=True, logprobs=0, extra_body=extra, **greedy)
    assert echo.choices[0].logprobs.tokens[:5] == [f"token_id:{i}" for i in ids[-5:]]
    whole = c.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": -1}, **greedy)
    assert whole.usage.prompt_tokens == len(ids)  # shorter than the context: all of it
    chat = c.chat.completions.create(
        messages=MESSAGES[:1], extra_body={"truncate_prompt_tokens": 4}, **greedy
    )
    assert chat.usage.prompt_tokens == 4
    for bad in (0, 256, -2):
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": bad}, **greedy)
        assert "truncate_prompt_tokens" in str(err.value.body)


def test_version(server: Server) -> None:
    from importlib.metadata import version

    r = httpx.get(f"{server.url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": version("medha")}


def test_allowed_token_ids_limit_what_is_drawn(server: Server) -> None:
    c = client(server)
    allowed = [40, 41, 42]
    out = c.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=10, seed=1,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                    "return_tokens_as_token_ids": True},
        logprobs=0,
    )  # fmt: skip
    got = {int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens}
    assert got <= set(allowed) and out.usage.completion_tokens == 10
    for bad, needle in (([], "allowed_token_ids must be"), ([1, 999999], "outside")):
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(
                model="tiny", prompt=[5], max_tokens=2, extra_body={"allowed_token_ids": bad}
            )
        assert err.value.body["param"] == "allowed_token_ids" and needle in str(err.value.body)


def test_allowed_tokens_min_tokens_holds_back_are_a_400_streaming_too(server: Server) -> None:
    eos = tiny_tokenizer().stop_token_ids[0]
    body = {"allowed_token_ids": [eos], "min_tokens": 1}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client(server).completions.create(
                model="tiny", prompt=[5, 6], max_tokens=3, stream=stream, extra_body=body
            )
        assert err.value.body["param"] == "allowed_token_ids"
        assert "min_tokens=1 holds back" in err.value.body["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_bad_words_never_appear_in_completions_or_chats(server: Server) -> None:
    c = client(server)
    greedy = {"model": "tiny", "max_tokens": 12, "temperature": 0.0}
    body = {"ignore_eos": True}
    text = c.completions.create(prompt="The quick brown fox", extra_body=body, **greedy)
    text = text.choices[0].text
    word = text[0]  # tiny's tokens are bytes: the greedy first character is one token
    assert word.isascii() and word.isprintable() and word != " "
    out = c.completions.create(
        prompt="The quick brown fox", extra_body={**body, "bad_words": [word]}, **greedy
    )
    assert word not in out.choices[0].text and out.usage.completion_tokens == 12
    chat = {"messages": [{"role": "user", "content": "hi"}], **greedy}
    reply = c.chat.completions.create(extra_body=body, **chat).choices[0].message.content
    word = next(ch for ch in reply if ch.isascii() and ch.isprintable() and ch != " ")
    banned = c.chat.completions.create(extra_body={**body, "bad_words": [word]}, **chat)
    assert word not in banned.choices[0].message.content


def test_bad_words_refusals_are_a_400_streaming_too(server: Server) -> None:
    cases = (
        ({"bad_words": ["ok", ""]}, "bad_words must be"),
        ({"bad_words": ["x"], "allowed_token_ids": [ord("x")]}, "no token could be drawn"),
    )
    for body, needle in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client(server).completions.create(
                    model="tiny", prompt=[5, 6], max_tokens=3, stream=stream, extra_body=body
                )
            assert err.value.body["param"] == "bad_words", err.value.body
            assert needle in err.value.body["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_echo_keeps_the_prompt_text_when_truncation_cuts_nothing(server: Server) -> None:
    greedy = {"model": "tiny", "max_tokens": 1, "temperature": 0.0}
    out = client(server).completions.create(
        prompt="hello there", echo=True, extra_body={"truncate_prompt_tokens": 200}, **greedy
    )
    assert out.choices[0].text.startswith("hello there")
