"""``serve --chat-template`` and ``--generation-config``: what replaces the model's own."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.server.conftest import start_server, stop_server

openai = pytest.importorskip("openai")


def chat_is_prompt(url: str, messages: list, prompt: str) -> Any:
    """Assert that the server's chat template renders ``messages`` as the text ``prompt``
    (their ``/tokenize`` tokens are equal); returns the prompt's ``/tokenize`` response."""
    import httpx

    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30)
    plain = httpx.post(
        f"{url}/tokenize", json={"prompt": prompt, "add_special_tokens": False}, timeout=30
    )
    assert chat.status_code == plain.status_code == 200, chat.text + plain.text
    assert chat.json()["tokens"] == plain.json()["tokens"]
    return plain


def test_the_served_chat_template_is_the_flags(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("<{{ messages[-1]['content'] }}>", encoding="utf-8")
    server = start_server("--chat-template", str(path), "--max-num-seqs", "2")
    try:
        messages = [{"role": "user", "content": "hello"}]
        plain = chat_is_prompt(server.url, messages, "<hello>")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        replies = [
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=3, temperature=0.0
            )
            for _ in range(3)
        ]
        assert all(r.usage.prompt_tokens == plain.json()["count"] for r in replies)
    finally:
        stop_server(server)


def test_a_chat_template_that_does_not_compile_is_one_line(tmp_path) -> None:
    path = tmp_path / "bad.jinja"
    path.write_text("{% for m in messages %}", encoding="utf-8")
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", "0"]
    proc = subprocess.run(
        [*cmd, "--chat-template", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("medha-runtime serve: error:") and "does not compile" in last
    assert f"{path}: chat template does not compile" in last


def test_unset_sampling_fields_come_from_the_generation_config(tmp_path) -> None:
    from medha_runtime.model.tiny import save_tiny

    model = save_tiny(tmp_path / "tiny")
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 4}), encoding="utf-8"
    )
    body = {"prompt": [5, 6, 7, 8], "ignore_eos": True}
    for flags, tokens in (((), 4), (("--generation-config", "vllm"), 16)):
        server = start_server(*flags, model=str(model))
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
            outs = [
                client.completions.create(
                    model=str(model), prompt=body["prompt"], extra_body={"ignore_eos": True}
                )
                for _ in range(2)
            ]
            assert [o.usage.completion_tokens for o in outs] == [tokens, tokens]
            if tokens == 4:  # temperature 0: greedy, the same twice
                assert outs[0].choices[0].text == outs[1].choices[0].text
            if tokens == 4:  # the chat default: the room left, at most max_new_tokens
                chat = client.chat.completions.create(
                    model=str(model),
                    messages=[{"role": "user", "content": "hi"}],
                    extra_body={"ignore_eos": True},
                )
                assert chat.usage.completion_tokens == 4
        finally:
            stop_server(server)


def test_max_new_tokens_only_lowers_a_completions_default_of_16(tmp_path) -> None:
    """vLLM: a completion's max_tokens defaults to 16, which the generation config's
    max_new_tokens can lower but not raise; a chat's defaults to it (within the room)."""
    from medha_runtime.model.tiny import save_tiny

    model = save_tiny(tmp_path / "tiny")
    (model / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 40}), encoding="utf-8"
    )
    server = start_server(model=str(model))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        extra = {"ignore_eos": True}
        done = client.completions.create(model=str(model), prompt=[5, 6, 7], extra_body=extra)
        assert done.usage.completion_tokens == 16
        chat = client.chat.completions.create(
            model=str(model), messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
        assert chat.usage.completion_tokens == 40
    finally:
        stop_server(server)


def test_inline_chat_template_escapes_are_read_as_vllm_reads_them(tmp_path) -> None:
    """``--chat-template '<{{ x }}>\\n'`` (a backslash and an n, as a shell passes them):
    vLLM unescapes inline template text, so the template ends in a real newline; a
    file's text is used as is."""
    from medha_runtime.cli import build_parser, engine_config

    def served(spec: str) -> str | None:
        args = build_parser().parse_args(["serve", "tiny", "--chat-template", spec])
        return engine_config(args, distributed=None).chat_template

    assert served("{{ 'é' }}\\n\\t\\u00e9\\\\") == "{{ 'é' }}\n\t\u00e9\\"
    path = tmp_path / "t.jinja"
    path.write_text("<{{ messages[-1]['content'] }}>\\n", encoding="utf-8")
    assert served(str(path)) == str(path)  # read as is when the engine loads it
    from medha_runtime.tokenizer import read_chat_template

    assert read_chat_template(str(path)).endswith(">\\n")


def test_inline_chat_template_newline_reaches_the_prompt() -> None:
    # (a template's last newline is dropped, as by transformers' Jinja settings)
    server = start_server("--chat-template", "<{{ messages[-1]['content'] }}>\\n.")
    try:
        chat_is_prompt(server.url, [{"role": "user", "content": "hello"}], "<hello>\n.")
    finally:
        stop_server(server)


def test_an_inline_chat_template_with_a_bad_escape_is_one_line() -> None:
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", "0"]
    proc = subprocess.run(
        [*cmd, "--chat-template", "{{ x }}\\x4"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("medha-runtime serve: error: chat template '{{ x }}\\\\x4':"), last
    assert "truncated \\xXX escape" in last
