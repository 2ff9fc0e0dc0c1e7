"""Tokenizer: byte-level round trips, streaming detokenization, chat templates, stop ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from medha_runtime.model import ConfigError, MissingFileError
from medha_runtime.model.tiny import BOS_ID, EOS_ID, save_tiny, tiny_tokenizer
from medha_runtime.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello, world!",
    "naïve café — ünïcödé",
    "日本語のテキスト",
    "emoji 🎉🦙 end",
    " lead\nand\ttabs ",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi ✓"},
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(text: str) -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = ()) -> list[str]:
    state = tok.detokenizer(prompt)
    pieces = [state.add([i]) for i in ids]
    pieces.append(state.flush())
    assert state.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_never_splits_a_character(text: str) -> None:
    tok = tiny_tokenizer()
    ids = [*tok.encode(text, add_special_tokens=False), EOS_ID]
    pieces = _stream(tok, ids, prompt=tok.encode("prompt: é"))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    if len(text.encode()) > len(text):  # multi-byte characters were held back
        assert "" in pieces[:-1]


def test_incremental_decode_flushes_a_truncated_character() -> None:
    tok = tiny_tokenizer()
    state = tok.detokenizer()
    assert state.add([ord("a")]) == "a"
    assert state.add(list("€".encode())[:2]) == ""  # 2 of 3 bytes
    assert state.flush() == "\ufffd"


def test_incremental_decode_keeps_spaces_of_a_bpe_tokenizer() -> None:
    bpe = tokenizers.ByteLevelBPETokenizer()
    corpus = ["the cat sat on the mat", "the dog ate the café food", "über naïve"] * 20
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, show_progress=False)
    tok = Tokenizer(bpe._tokenizer)
    text = " the cat ate the café über food"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges happened
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == text


class _CountingDecode:
    """Wraps a ``tokenizers.Tokenizer``: counts its ``decode`` calls."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self.inner, self.calls = inner, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_single_token_texts_are_remembered_and_equal_a_fresh_decode() -> None:
    tok = tiny_tokenizer()
    for skip in (True, False):
        for i in range(tok.vocab_size):
            assert tok.decode_token(i, skip) == tok.decode([i], skip_special_tokens=skip)
            assert tok.decode_token(i, skip) == tok.decode([i], skip_special_tokens=skip)
    assert tok.decode_token(EOS_ID) == "" and tok.decode_token(EOS_ID, False) == "</s>"
    # a stream decodes each generated token's window once (the other window is remembered)
    counted = _CountingDecode(tok.tokenizer)
    tok.tokenizer = counted
    text = "plain ascii text, then: naïve café 🎉 end"
    ids = tok.encode(text, add_special_tokens=False)
    state = tok.detokenizer(tok.encode("prompt"))
    counted.calls = 0
    pieces = [state.add([i]) for i in ids]
    assert "".join(pieces) + state.flush() == text
    held = sum(1 for p in pieces if p == "")  # a held-back byte widens the next windows
    assert counted.calls <= len(ids) + 2 * held + 2


@pytest.mark.parametrize("skip", [True, False])
def test_a_stream_with_remembered_texts_equals_one_without(skip: bool) -> None:
    bpe = tokenizers.ByteLevelBPETokenizer()
    corpus = ["the cat sat on the mat", "the dog ate the café food", "über naïve"] * 20
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, show_progress=False)
    bpe.add_special_tokens(["<eos>"])
    tok = Tokenizer(bpe._tokenizer)
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode(" the cat ate the café über food"), eos, *tok.encode(" the mat")]

    def stream(remember: bool) -> list[str]:
        state = tok.detokenizer(tok.encode("über"), skip_special_tokens=skip)
        if not remember:  # every window decoded afresh
            state._decode = lambda w: tok.decode(w, skip_special_tokens=skip)
        return [*(state.add([i]) for i in ids), state.flush()]

    assert stream(True) == stream(False)
    assert "".join(stream(True)) == tok.decode(ids, skip_special_tokens=skip)


def _write_tokenizer_dir(path: Path, *, template_in_config=None, jinja=None, generation=None):
    path.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer().tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    if template_in_config is not None:
        config["chat_template"] = template_in_config
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_chat_template_from_tokenizer_config(tmp_path) -> None:
    tok = Tokenizer.from_pretrained_dir(_write_tokenizer_dir(tmp_path, template_in_config=TEMPLATE))
    text = tok.apply_chat_template(CHAT)
    assert text == "<s>[system] Be brief.</s>[user] Hi ✓</s>[assistant] "
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False).endswith("✓</s>")
    ids = tok.apply_chat_template(CHAT, tokenize=True)
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID  # no double BOS


def test_chat_template_from_jinja_file_takes_precedence(tmp_path) -> None:
    path = _write_tokenizer_dir(tmp_path, template_in_config="config {{ 1 }}", jinja="file {{ 2 }}")
    assert Tokenizer.from_pretrained_dir(path).apply_chat_template(CHAT) == "file 2"
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    tok = Tokenizer.from_pretrained_dir(path)
    assert tok.apply_chat_template(CHAT[1:]) == "[user] Hi ✓</s>[assistant] "  # no bos_token


def test_chat_template_list_form_raise_exception_and_missing(tmp_path) -> None:
    listed = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "dflt"}]
    tok = Tokenizer.from_pretrained_dir(
        _write_tokenizer_dir(tmp_path / "a", template_in_config=listed)
    )
    assert tok.apply_chat_template(CHAT) == "dflt"
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    tok = Tokenizer.from_pretrained_dir(_write_tokenizer_dir(tmp_path / "b", jinja=strict))
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template(CHAT)
    tok = Tokenizer.from_pretrained_dir(_write_tokenizer_dir(tmp_path / "c"))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CHAT)


@pytest.mark.parametrize("template", [5, None, ["x"]])
def test_chat_template_list_default_that_is_not_a_string(tmp_path, template) -> None:
    listed = [{"name": "default", "template": template}]
    with pytest.raises(ConfigError) as info:
        Tokenizer.from_pretrained_dir(_write_tokenizer_dir(tmp_path, template_in_config=listed))
    assert "tokenizer_config.json" in str(info.value) and "default" in str(info.value)


def test_chat_template_is_sandboxed(tmp_path) -> None:
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_pretrained_dir(_write_tokenizer_dir(tmp_path, jinja=evil))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(CHAT)


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        (None, (EOS_ID,)),
        ({"eos_token_id": 5}, (5, EOS_ID)),
        ({"eos_token_id": [7, EOS_ID, 9]}, (7, EOS_ID, 9)),
    ],
)
def test_stop_ids_merge_generation_config_and_eos(tmp_path, generation, expected) -> None:
    tok = Tokenizer.from_pretrained_dir(_write_tokenizer_dir(tmp_path, generation=generation))
    assert tok.eos_token_id == EOS_ID and tok.bos_token_id == BOS_ID
    assert tok.stop_token_ids == expected


def test_missing_and_broken_files(tmp_path) -> None:
    with pytest.raises(MissingFileError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained_dir(tmp_path)
    path = _write_tokenizer_dir(tmp_path / "m")
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config\.json"):
        Tokenizer.from_pretrained_dir(path)
    (path / "generation_config.json").write_bytes(b'{"eos_token_id": "\xff"}')
    with pytest.raises(ConfigError, match=r"generation_config\.json"):
        Tokenizer.from_pretrained_dir(path)


@pytest.mark.parametrize("eos", ["eos", [2, None], {"id": 2}, True, 2.5, -1])
def test_bad_generation_eos_ids_name_the_file(tmp_path, eos) -> None:
    path = _write_tokenizer_dir(tmp_path, generation={"eos_token_id": eos})
    with pytest.raises(ConfigError) as info:
        Tokenizer.from_pretrained_dir(path)
    message = str(info.value)
    assert str(path / "generation_config.json") in message and "eos_token_id" in message, message


def test_chat_template_file_not_utf8_names_the_file(tmp_path) -> None:
    path = _write_tokenizer_dir(tmp_path)
    (path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    with pytest.raises(ConfigError) as info:
        Tokenizer.from_pretrained_dir(path)
    assert str(path / "chat_template.jinja") in str(info.value) and "UTF-8" in str(info.value)


def test_saved_tiny_tokenizer_matches_the_in_memory_one(tmp_path) -> None:
    path = save_tiny(tmp_path / "tiny")
    loaded, memory = Tokenizer.from_pretrained_dir(path), tiny_tokenizer()
    for text in TEXTS:
        assert loaded.encode(text) == memory.encode(text)
    assert loaded.apply_chat_template(CHAT) == memory.apply_chat_template(CHAT)
    assert loaded.stop_token_ids == memory.stop_token_ids == (EOS_ID,)
    assert loaded.vocab_size == 259


PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_read_chat_template_from_a_file_or_text_and_errors_named(tmp_path) -> None:
    from medha_runtime.tokenizer import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(PLAIN_TEMPLATE, encoding="utf-8")
    assert read_chat_template(path) == PLAIN_TEMPLATE
    assert read_chat_template(str(path)) == PLAIN_TEMPLATE
    assert read_chat_template(PLAIN_TEMPLATE) == PLAIN_TEMPLATE
    with pytest.raises(ChatTemplateError, match=r"nope\.jinja.*no such file"):
        read_chat_template(str(tmp_path / "nope.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        read_chat_template("{% for m in messages %}")
    bad = tmp_path / "latin1.jinja"
    bad.write_bytes("{{ 'é' }}".encode("latin-1"))
    with pytest.raises(ChatTemplateError, match=r"latin1\.jinja: not UTF-8"):
        read_chat_template(bad)
    with pytest.raises(ChatTemplateError, match="got ''"):
        read_chat_template("")


def test_with_chat_template_replaces_only_the_copy() -> None:
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    before = tok.apply_chat_template(msgs)
    other = tok.with_chat_template(PLAIN_TEMPLATE)
    assert other.apply_chat_template(msgs) == "[user] hi\n"
    assert tok.apply_chat_template(msgs) == before != "[user] hi\n"
    assert other.stop_token_ids == tok.stop_token_ids


def test_continue_final_message_ends_after_its_content() -> None:
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    full = tok.apply_chat_template(msgs, add_generation_prompt=False)
    cont = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert full.startswith(cont) and cont.endswith("The answer is") and full != cont
    # a template that trims the content: the stripped content is found
    trim = tok.with_chat_template("{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}")
    padded = [{"role": "assistant", "content": "  go on  "}]
    got = trim.apply_chat_template(padded, add_generation_prompt=False, continue_final_message=True)
    assert got == "[go on"
    with pytest.raises(ChatTemplateError, match="needs add_generation_prompt=False"):
        tok.apply_chat_template(msgs, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="text content to continue"):
        tok.apply_chat_template(
            [{"role": "user", "content": " "}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
    hide = tok.with_chat_template("{% for m in messages %}x{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not contain the final message"):
        hide.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)


def test_template_variables_reach_the_template_and_reserved_ones_are_refused() -> None:
    tok = tiny_tokenizer().with_chat_template(
        "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"
    )
    msgs = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs, enable_thinking=True) == "<think>q"
    assert tok.apply_chat_template(msgs, enable_thinking=False) == "q"
    from medha_runtime.tokenizer import template_variables

    assert template_variables({"enable_thinking": True}) == {"enable_thinking": True}
    assert template_variables(None) == {}
    with pytest.raises(ChatTemplateError, match="'add_generation_prompt', 'messages' cannot"):
        template_variables({"messages": [], "add_generation_prompt": 1, "x": 2})
