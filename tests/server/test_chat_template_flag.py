"""``serve --chat-template``: the template replaces the model's for every chat request."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import start_server, stop_server

openai = pytest.importorskip("openai")


def test_the_served_chat_template_is_the_flags(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("<{{ messages[-1]['content'] }}>", encoding="utf-8")
    server = start_server("--chat-template", str(path), "--max-num-seqs", "2")
    try:
        import httpx

        messages = [{"role": "user", "content": "hello"}]
        chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
        plain = httpx.post(
            f"{server.url}/tokenize",
            json={"prompt": "<hello>", "add_special_tokens": False},
            timeout=30,
        )
        assert chat.status_code == plain.status_code == 200, chat.text + plain.text
        assert chat.json()["tokens"] == plain.json()["tokens"]
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
