"""The front end's pure parts: field checks, OpenAI shapes, token strings (no server)."""

from __future__ import annotations

import pytest

from medha_runtime.server import formatting as fmt
from medha_runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RefusedField,
    check_request,
    check_text,
    unknown_fields,
)


def test_off_values_pass_and_others_are_refused() -> None:
    ok = CompletionRequest(prompt="x", suffix=None, best_of=2, n=2, use_beam_search=False)
    check_request(ok, chat=False)
    chat = ChatCompletionRequest(
        messages=[{"role": "developer", "content": [{"type": "text", "text": "hi"}]}],
        response_format={"type": "text"},
        tool_choice="none",
    )
    check_request(chat, chat=True)
    with pytest.raises(RefusedField) as err:
        check_request(CompletionRequest(prompt="x", guided_json={"a": 1}), chat=False)
    assert err.value.param == "guided_json"
    with pytest.raises(RefusedField, match="only text parts") as err:
        bad = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
        check_request(ChatCompletionRequest(messages=bad), chat=True)
    assert err.value.param == "messages[0].content[0].type"


def test_check_text_names_where_a_lone_surrogate_is() -> None:
    ok = ChatCompletionRequest(
        messages=[{"role": "user", "content": "h\u00e9 \U0001f600"}], stop=["\n"], my_field="\x00"
    )
    check_text(ok)
    check_text(CompletionRequest(prompt=[[1, 2], [3]]))
    for body, param in [
        (CompletionRequest(prompt=["ok", "a\ud800"]), "prompt[1]"),
        (
            CompletionRequest(prompt="x", stream=True, stream_options={"z": "\udfff"}),
            "stream_options.z",
        ),
        (CompletionRequest(prompt="x", extra_thing={"k": ["\udc80"]}), "extra_thing.k[0]"),
        (CompletionRequest(prompt="x", extra_thing={"\ud800": 1}), "extra_thing.\\ud800"),
        (
            ChatCompletionRequest(
                messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]
            ),
            "messages[0].content[0].text",
        ),
    ]:
        with pytest.raises(RefusedField, match="lone surrogate") as err:
            check_text(body)
        assert err.value.param == param
        assert err.value.param in str(err.value)
        str(err.value).encode("utf-8")  # the message itself can be answered


def test_cache_salt_is_a_field_and_an_empty_one_is_refused() -> None:
    # vLLM's cache_salt keeps a tenant's prompts out of other tenants' prefix-cache
    # hits: it is a declared field (carried to the engine), not an unknown one
    for body in (
        CompletionRequest(prompt="x", cache_salt="tenant-a"),
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], cache_salt="t"),
    ):
        chat = isinstance(body, ChatCompletionRequest)
        check_request(body, chat=chat)
        assert body.cache_salt and unknown_fields(body) == []
        with pytest.raises(RefusedField, match="cache_salt: must be a non-empty") as err:
            check_request(body.model_copy(update={"cache_salt": ""}), chat=chat)
        assert err.value.param == "cache_salt"
    check_request(CompletionRequest(prompt="x", cache_salt=None), chat=False)


def test_a_text_part_without_its_text_is_named_as_such() -> None:
    # it was "only text parts are supported, got type 'text'"
    for part in ({"type": "text"}, {"type": "text", "text": 5}):
        with pytest.raises(RefusedField, match=r"content\[1\]\.text: a text part needs a string"):
            msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]
            check_request(ChatCompletionRequest(messages=msgs), chat=True)


def test_unknown_fields_are_listed_once_known_ones_are_not() -> None:
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi", "colour": 1}],
        frobnicate=True,
        best_of=1,
        stream=True,
        stream_options={"include_usage": True, "extra_option": 2},
    )
    assert unknown_fields(body) == [
        "frobnicate",
        "stream_options.extra_option",
        "messages[].colour",
    ]


def test_served_name_only() -> None:
    from medha_runtime.server.protocol import APIError
    from medha_runtime.server.routes import Frontend

    front = Frontend(None, None, None, model_name="mytiny")  # type: ignore[arg-type]
    front.check_model("mytiny")
    front.check_model(None)
    with pytest.raises(APIError) as err:
        front.check_model("tiny")
    assert err.value.status == 404 and err.value.param == "model"


TEXT = fmt.TokenText(lambda t: {1: "a", 2: "b", 3: "bytes:\\xe2"}[t], lambda t: bytes([t]))


def test_completion_logprobs_shape() -> None:
    entries = [None, {2: -0.5, 1: -1.0}, {3: -2.0, 1: -0.1, 2: -3.0}]
    out = fmt.completion_logprobs([1, 2, 3], entries, TEXT, top=1, pieces=["a", "b", ""])
    assert out["tokens"] == ["a", "b", "bytes:\\xe2"]
    assert out["token_logprobs"] == [None, -0.5, -2.0]
    # the top one, and the chosen token always
    assert out["top_logprobs"] == [None, {"b": -0.5}, {"a": -0.1, "bytes:\\xe2": -2.0}]
    assert out["text_offset"] == [0, 1, 2]


def test_text_offsets_index_the_text_not_the_token_strings() -> None:
    """A partial character ("bytes:\\xe2", 10 characters as a token string) adds no
    text; the token that completes it adds the character: offsets into "a€b"."""
    entries = [None, {3: -1.0}, {2: -1.0}]
    out = fmt.completion_logprobs([1, 3, 2], entries, TEXT, top=0, pieces=["a", "", "€b"])
    assert out["text_offset"] == [0, 1, 1]
    out = fmt.completion_logprobs([3, 2], entries[1:], TEXT, top=0, pieces=["", "x"], text_offset=5)
    assert out["text_offset"] == [5, 5]


def test_fit_pieces_join_to_the_text() -> None:
    assert fmt.fit_pieces(["<s>", "Hi", " there"], "<s>Hi there") == ["<s>", "Hi", " there"]
    # a decoding that differs from the text (one more space): offsets stay inside it
    assert fmt.fit_pieces(["", " Hi", " there"], "Hi there") == ["", "Hi ", "there"]
    assert fmt.fit_pieces(["a", "b"], "abcd") == ["a", "bcd"]
    assert fmt.fit_pieces([], "") == []


def test_prompt_logprobs_ranks() -> None:
    # the prompt token first; then the top 2 (the prompt token is one of them, or not)
    inside = {2: -0.2, 1: -1.5}  # top 2 = {2, 1}
    outside = {3: -4.0, 1: -0.3, 2: -1.2}  # top 2 = {1, 2}; 3 is below them
    out = fmt.prompt_logprobs([None, inside, outside], TEXT, top=2)
    assert out[0] is None
    assert out[1] == {
        "2": {"logprob": -0.2, "rank": 1, "decoded_token": "b"},
        "1": {"logprob": -1.5, "rank": 2, "decoded_token": "a"},
    }
    assert out[2]["3"]["rank"] is None and out[2]["1"]["rank"] == 1 and out[2]["2"]["rank"] == 2


def test_prompt_logprobs_write_only_the_top_asked() -> None:
    """``echo`` with ``logprobs=3`` has the engine keep 3 alternatives per prompt token;
    ``prompt_logprobs=0`` still writes only the prompt token (it wrote all 3, and rank
    None for a prompt token that was the most likely)."""
    entry = {2: -0.1, 1: -2.0, 3: -3.0}  # the prompt token 2 is the most likely
    assert fmt.prompt_logprobs([entry], TEXT, top=0)[0] == {
        "2": {"logprob": -0.1, "rank": None, "decoded_token": "b"}
    }
    assert fmt.prompt_logprobs([entry], TEXT, top=1)[0] == {
        "2": {"logprob": -0.1, "rank": 1, "decoded_token": "b"}
    }
    below = {3: -3.0, 2: -0.1, 1: -2.0}  # the prompt token 3 is below the top 1
    out = fmt.prompt_logprobs([below], TEXT, top=1)[0]
    assert out == {
        "3": {"logprob": -3.0, "rank": None, "decoded_token": "bytes:\\xe2"},
        "2": {"logprob": -0.1, "rank": 1, "decoded_token": "b"},
    }
    assert list(out) == ["3", "2"]  # the prompt token first, as the engine orders it


def test_infinite_logprobs_are_written_as_json_numbers() -> None:
    """A logprob of -inf (a token ``top_k`` ruled out had one, when logprobs were of the
    processed distribution) is not JSON: the stream wrote ``-Infinity``, the plain
    answer ``null``. It is written as vLLM writes it, -9999.0."""
    import json

    inf = float("-inf")
    entries = [{1: -0.1, 2: inf, 3: inf}]
    out = [
        fmt.completion_logprobs([1], entries, TEXT, top=3, pieces=["a"]),
        fmt.chat_logprobs([1], entries, TEXT, top=3),
        fmt.prompt_logprobs([{2: inf, 1: -0.1, 3: inf}], TEXT, top=3),
    ]
    text = json.dumps(out, allow_nan=False)  # raises on an infinity
    assert text.count("-9999.0") == 6
    assert out[0]["top_logprobs"][0] == {"a": -0.1, "b": -9999.0, "bytes:\\xe2": -9999.0}
    assert [t["logprob"] for t in out[1]["content"][0]["top_logprobs"]] == [-0.1, -9999.0, -9999.0]
    assert out[2][0]["2"]["logprob"] == -9999.0 and out[2][0]["2"]["rank"] in (2, 3)


def test_usage_counts_and_cached_tokens() -> None:
    assert fmt.usage(5, 7) == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert fmt.usage(5, 7, 3)["prompt_tokens_details"] == {"cached_tokens": 3}


def _data(tok: object) -> object:
    from medha_runtime.server.messages import TokenizerData

    return TokenizerData(
        json=tok.to_str(),  # type: ignore[attr-defined]
        bos_token=None,
        eos_token=None,
        chat_template=None,
        stop_token_ids=(),
    )


def test_token_strings_and_bytes_byte_fallback() -> None:
    """A SentencePiece-style vocabulary: ``<0xNN>`` pieces are bytes, ``▁`` a space."""
    import tokenizers
    from tokenizers import decoders, models

    from medha_runtime.server.tokens import FrontTokenizer

    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x82>": 2, "<0xAC>": 3, "\u2581hello": 4, "é": 5}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    front = FrontTokenizer(_data(tok))  # type: ignore[arg-type]
    assert front.token_bytes(1) == b"\xe2" and front.token_str(1) == "bytes:\\xe2"
    assert front.token_bytes(4) == b" hello" and front.token_str(4) == " hello"
    assert front.token_bytes(5) == "é".encode() and front.token_str(5) == "é"
    strs = {front.token_str(t) for t in range(1, 4)}
    assert len(strs) == 3  # three byte tokens, three keys (they all decode to U+FFFD)


def test_token_strings_and_bytes_byte_level() -> None:
    """A GPT-2 byte-level vocabulary: each character stands for one byte."""
    import tokenizers
    from tokenizers import decoders, models

    from medha_runtime.server.tokens import FrontTokenizer
    from medha_runtime.tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab[b2u[0x20] + "hi"] = 256
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    front = FrontTokenizer(_data(tok))  # type: ignore[arg-type]
    assert front.token_bytes(0xE2) == b"\xe2" and front.token_str(0xE2) == "bytes:\\xe2"
    assert front.token_bytes(256) == b" hi" and front.token_str(256) == " hi"
    assert front.token_str(ord("A")) == "A"


def test_an_event_stays_one_line_for_any_text() -> None:
    """Every character ``str.splitlines`` breaks on (httpx's ``aiter_lines`` does) stays
    inside its event, and the text comes back whole."""
    import json

    from httpx._decoders import LineDecoder

    text = "a\nb\rc\x0bd\x0ce\x1cf\x1dg\x1eh\x85i\u2028j\u2029k"
    event = fmt.sse({"choices": [{"text": text}]})
    lines = [line for line in LineDecoder().decode(event) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["text"] == text


def test_logit_bias_keys_must_be_ascii_digits() -> None:
    """'²' and '①' are digits to str.isdigit but not to int(): they passed this check and
    reached the vocabulary check's int(), a 500."""
    for key in ("²", "①", "١٢", "-3", "x"):
        with pytest.raises(RefusedField, match="logit_bias: keys must be token ids") as err:
            check_request(CompletionRequest(prompt="x", logit_bias={key: 1}), chat=False)
        assert err.value.param == "logit_bias"
    check_request(CompletionRequest(prompt="x", logit_bias={" 12 ": 1}), chat=False)


def test_a_long_text_encodes_to_the_same_ids_off_the_gil() -> None:
    """Past ``LONG_TEXT_CHARS`` the front's tokenizer encodes with ``encode_batch`` (it
    releases the GIL): the ids, and a chat's, are the engine tokenizer's."""
    from medha_runtime.model.tiny import tiny_tokenizer
    from medha_runtime.server.engine_proc import _tokenizer_data
    from medha_runtime.server.tokens import LONG_TEXT_CHARS, FrontTokenizer

    tok = tiny_tokenizer()
    front = FrontTokenizer(_tokenizer_data(tok))
    text = "héllo wörld <|endoftext|> \n" * (LONG_TEXT_CHARS // 10)
    assert len(text) > LONG_TEXT_CHARS
    for special in (True, False):
        assert front.encode(text, special) == tok.encode(text, add_special_tokens=special)
    chat = [{"role": "user", "content": text}]
    for tokenize in (True, False):
        got = front.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)
        assert got == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)


def test_unknown_field_names_are_remembered_up_to_a_bound(caplog) -> None:
    """Each unknown name is warned about once; a client sending new names in every request
    grew the set of names warned about without bound."""
    import logging

    from medha_runtime.server.protocol import CompletionRequest
    from medha_runtime.server.routes import MAX_WARNED_FIELDS, Frontend

    front = Frontend(None, None, None, model_name="m")  # check_fields reads none of them
    with caplog.at_level(logging.WARNING, logger="medha_runtime.server.routes"):
        for i in range(MAX_WARNED_FIELDS + 50):
            body = CompletionRequest(model="m", prompt="p", **{f"x{i}": 1, "x0": 1})
            front.check_fields(body, chat=False)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("'x0' is not known" in m for m in lines) == 1
    assert sum("is not known to Medha" in m for m in lines) == MAX_WARNED_FIELDS
    assert (
        lines[-1]
        == f"more than {MAX_WARNED_FIELDS} unknown request field names: no more are logged"
    )
    assert len(front._warned) == MAX_WARNED_FIELDS + 1


def test_check_text_reads_lists_that_start_with_a_number() -> None:
    """Only the token-id fields' lists are skipped by their first item: ``[1, "\\ud800"]``
    in ``chat_template_kwargs`` passed, and a template that printed it was a 500."""
    from medha_runtime.server.protocol import ChatCompletionRequest, RefusedField, check_text

    msgs = [{"role": "user", "content": "x"}]
    body = ChatCompletionRequest(
        model="m", messages=msgs, chat_template_kwargs={"x": [1, "\ud800"]}
    )
    with pytest.raises(RefusedField, match=r"^chat_template_kwargs\.x\[1\]: a string holds"):
        check_text(body)
    check_text(CompletionRequest(model="m", prompt=[[1, 2], [3]], stop_token_ids=[4]))


def test_null_is_the_default_where_vllm_takes_null() -> None:
    """vLLM declares these Optional: a client sending null got a 400 here."""
    body = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "stream": None,
            "echo": None,
            "n": None,
            "return_tokens_as_token_ids": None,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None},
        }
    )
    assert (body.stream, body.echo, body.n, body.return_tokens_as_token_ids) == (
        False,
        False,
        1,
        False,
    )
    assert not body.stream_options.include_usage and not body.stream_options.continuous_usage_stats
    msgs = [{"role": "user", "content": "x"}]
    chat = ChatCompletionRequest.model_validate({"messages": msgs, "logprobs": None, "n": None})
    assert (chat.logprobs, chat.n) == (False, 1)
    with pytest.raises(ValueError, match="stream"):  # a wrong value is still refused
        CompletionRequest.model_validate({"prompt": "x", "stream": "sometimes"})
    with pytest.raises(ValueError, match="ignore_eos"):  # vLLM takes no null here either
        CompletionRequest.model_validate({"prompt": "x", "ignore_eos": None})
