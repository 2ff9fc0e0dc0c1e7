"""Stop strings and concurrent requests, through the real openai client, on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest

from tests.server.conftest import API_KEY, Server, start_server, stop_server

openai = pytest.importorskip("openai")

TIMEOUT = 60.0
GREEDY = {"model": "tiny", "temperature": 0, "extra_body": {"ignore_eos": True}}


BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """conftest's server, with a fixed cost model (no start-up calibration: faster)
    and a 64 KiB body limit."""
    s = start_server(
        "--cost-model",
        "affine:base=0.01,per_token=0.0001,per_attn=0",
        "--max-body-bytes",
        str(BODY_LIMIT),
        api_key=API_KEY,
    )
    try:
        yield s
    finally:
        stop_server(s)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0
    )


class Answer(NamedTuple):
    text: str
    finish_reason: str | None
    stop_reason: object
    prompt_tokens: int
    completion_tokens: int


class Job(NamedTuple):
    chat: bool
    stream: bool
    prompt: str
    max_tokens: int


def ask(server: Server, job: Job, **kw: object) -> Answer:
    """One request; streamed answers are joined (their usage comes from the last chunk)."""
    c = client(server)
    args: dict = {**GREEDY, "max_tokens": job.max_tokens, "stream": job.stream, **kw}
    if job.stream:
        args["stream_options"] = {"include_usage": True}
    if job.chat:
        r = c.chat.completions.create(messages=[{"role": "user", "content": job.prompt}], **args)
    else:
        r = c.completions.create(prompt=job.prompt, **args)
    if not job.stream:
        ch = r.choices[0]
        text = ch.message.content if job.chat else ch.text
        u = r.usage
        stop = (ch.model_extra or {}).get("stop_reason")
        return Answer(text, ch.finish_reason, stop, u.prompt_tokens, u.completion_tokens)
    parts: list[str] = []
    finish = stop = usage = None
    for chunk in r:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append((ch.delta.content or "") if job.chat else ch.text)
            if ch.finish_reason is not None:
                finish, stop = ch.finish_reason, (ch.model_extra or {}).get("stop_reason")
    assert usage is not None, "the stream carried no usage chunk"
    return Answer("".join(parts), finish, stop, usage.prompt_tokens, usage.completion_tokens)


def pick_stop(text: str) -> tuple[str, int]:
    """A two-character printable ASCII stop string first occurring at index >= 2 of ``text``."""
    for i in range(2, len(text) - 1):
        s = text[i : i + 2]
        if all(32 < ord(ch) < 127 for ch in s) and text.index(s) == i:
            return s, i
    raise AssertionError(f"no usable stop string in {text!r}")


# ---------------------------------------------------------------- stop strings
@pytest.fixture(scope="module")
def stop_case(server: Server) -> tuple[str, str, int, Answer]:
    """A prompt, a stop string from its greedy output, where it starts, and the full answer."""
    for prompt in ("Medha shards the KV cache", "one two three four five", "hello"):
        full = ask(server, Job(False, False, prompt, 24))
        try:
            stop, at = pick_stop(full.text)
        except AssertionError:
            continue
        return prompt, stop, at, full
    pytest.fail("none of the prompts' greedy outputs has a printable two-character substring")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_ends_the_completion(server: Server, stop_case: tuple, stream: bool) -> None:
    prompt, stop, at, full = stop_case
    got = ask(server, Job(False, stream, prompt, 24), stop=[stop, "never-seen-stop"])
    assert got.text == full.text[:at], (got.text, full.text, stop)
    assert stop not in got.text
    assert got.finish_reason == "stop"
    assert got.stop_reason == stop
    assert got.completion_tokens < full.completion_tokens
    assert got.prompt_tokens == full.prompt_tokens


def test_stop_string_included_when_asked(server: Server, stop_case: tuple) -> None:
    prompt, stop, at, full = stop_case
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    plain = ask(server, Job(False, False, prompt, 24), stop=stop, extra_body=body)
    streamed = ask(server, Job(False, True, prompt, 24), stop=stop, extra_body=body)
    assert plain.text == streamed.text == full.text[: at + len(stop)]
    assert plain.finish_reason == streamed.finish_reason == "stop"


def test_stop_string_in_chat(server: Server) -> None:
    full = ask(server, Job(True, False, "Tell me about Medha", 24))
    stop, at = pick_stop(full.text)
    for stream in (False, True):
        got = ask(server, Job(True, stream, "Tell me about Medha", 24), stop=stop)
        assert (got.text, got.finish_reason) == (full.text[:at], "stop"), stream


# ---------------------------------------------------------- concurrent requests
JOBS = [
    Job(chat=i % 4 >= 2, stream=i % 2 == 1, prompt=p, max_tokens=3 + i)
    for i, p in enumerate(
        [
            "hello",
            "The sky over the port was",
            "Medha shards the KV cache of long prompts",
            "one two three four five",
            "a",
            "What is the capital of France?",
            "x" * 40,
            "Concurrency is not parallelism",
        ]
    )
]


def test_concurrent_requests_match_sequential(server: Server) -> None:
    alone = [ask(server, job) for job in JOBS]
    with ThreadPoolExecutor(len(JOBS)) as pool:
        together = list(pool.map(lambda job: ask(server, job), JOBS))
    for job, a, b in zip(JOBS, alone, together, strict=True):
        assert b == a, job
        assert b.finish_reason == "length"
        assert b.completion_tokens == job.max_tokens
        assert b.prompt_tokens > 0


def test_concurrent_requests_with_stops_and_lengths(server: Server, stop_case: tuple) -> None:
    prompt, stop, at, full = stop_case
    jobs = [Job(False, i % 2 == 1, prompt, 24) for i in range(3)]
    with ThreadPoolExecutor(2 * len(jobs)) as pool:
        stopped = [pool.submit(ask, server, j, stop=stop) for j in jobs]
        plain = [pool.submit(ask, server, j) for j in jobs]
        got_stopped = [f.result() for f in stopped]
        got_plain = [f.result() for f in plain]
    for a in got_stopped:
        assert (a.text, a.finish_reason, a.stop_reason) == (full.text[:at], "stop", stop)
    for a in got_plain:
        assert a == full


def test_max_body_bytes_flag(server: Server) -> None:
    import httpx

    url = f"{server.url}/v1/completions"
    big = {"model": "tiny", "prompt": "a" * (BODY_LIMIT + 10), "max_tokens": 1}
    r = httpx.post(url, json=big, headers=server.headers, timeout=30)
    assert r.status_code == 413, r.text
    assert "error" in r.json() and str(BODY_LIMIT) in r.json()["error"]["message"]
    ok = {"model": "tiny", "prompt": "a" * 100, "max_tokens": 1}
    assert httpx.post(url, json=ok, headers=server.headers, timeout=30).status_code == 200


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--cost-model", "table:/no/such/profile.json"], "cannot read table file"),
        (["--step-log", "/no/such/dir/steps.jsonl"], "cannot write the step log"),
    ],
)
def test_engine_start_failure_is_one_line(tmp_path, flags: list[str], needle: str) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", "0", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("medha-runtime serve: error: the engine failed to start:")
        and needle in last
    )


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_outside_0_65535_is_one_usage_line(tmp_path, port: str) -> None:
    """``--port 70000`` ended in socket's OverflowError traceback (bind_socket caught OSError
    only); a port is now checked with the other flags, before anything starts."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", port]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "argument --port" in proc.stderr.strip().splitlines()[-1]
