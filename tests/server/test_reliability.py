"""Reliability of ``medha-runtime serve`` on the tiny model, over loopback.

Load, client disconnects, KV memory pressure, a killed worker and malformed
input; see docs/reliability.md. ``pytest -s`` prints the measured figures.
``MEDHA_RELIABILITY_LOAD_S`` sets the load test's length (default 20 s; the soak runs 60).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEY, Server, start_server, stop_server

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

LOAD_S = float(os.environ.get("MEDHA_RELIABILITY_LOAD_S", "20"))  # the soak: 60 or more
LOAD_CLIENTS = 64
REQUEST_TIMEOUT_S = 60.0  # a request still open after this long counts as a hang
DISCONNECT_CLIENTS = 200
ERROR_KEYS = {"message", "type", "param", "code"}


# ------------------------------------------------------------------ helpers
def metrics(server: Server) -> dict[str, float]:
    """Every sample of /metrics by name; a counter's labelled samples (``_total``) are summed."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
            else:
                out.setdefault(s.name, s.value)
    return out


def finished(server: Server) -> dict[str, float]:
    """``medha:request_success_total`` by finish reason."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        s.labels["finished_reason"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "medha:request_success_total"
    }


def wait_idle(server: Server, within_s: float) -> dict[str, float]:
    """Poll /metrics until nothing runs, nothing waits and no KV is held."""
    deadline = time.monotonic() + within_s
    while True:
        m = metrics(server)
        idle = m["medha:num_requests_running"] == 0 and m["medha:num_requests_waiting"] == 0
        if (idle and m["medha:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def assert_idle(server: Server, within_s: float = 5.0) -> None:
    m = wait_idle(server, within_s)
    assert m["medha:num_requests_running"] == 0, m
    assert m["medha:num_requests_waiting"] == 0, m
    assert m["medha:kv_cache_usage_perc"] == 0, m


def assert_error_body(body: Any, status: int) -> str:
    """An OpenAI-shaped error; returns its message."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert err["code"] == status, err
    assert isinstance(err["message"], str) and err["message"], err
    return err["message"]


def assert_serves(server: Server) -> None:
    """/health is 200 and a fresh request through the openai client succeeds."""
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    c = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key or "none", timeout=30, max_retries=0
    )
    r = c.completions.create(
        model="tiny", prompt="hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def descendants(pid: int) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process below ``pid``."""
    table: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
            table[int(d.name)] = (ppid, cmd)
    out: dict[int, tuple[int, str]] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for p, (pp, cmd) in table.items():
            if pp == parent and p not in out:
                out[p] = (pp, cmd)
                frontier.append(p)
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def read_sse(r: httpx.Response, stop_after: int | None = None) -> list[Any]:
    """The data events of a stream (``"[DONE]"`` kept as a string)."""
    events: list[Any] = []
    async for line in r.aiter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
        if data == "[DONE]" or (stop_after is not None and len(events) >= stop_after):
            break
    return events


# ----------------------------------------------------------- shared server
@pytest.fixture(scope="module")
def main_server() -> Iterator[Server]:
    s = start_server("--kv-cache-tokens", "8192", api_key=API_KEY)
    try:
        yield s
    finally:
        stop_server(s)


# --------------------------------------------------------------------- load
@dataclass
class LoadStats:
    completed: int = 0
    tokens: int = 0
    hangs: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


async def one_load_request(http: httpx.AsyncClient, server: Server, n: int, st: LoadStats) -> None:
    chat = n % 2 == 1
    body: dict[str, Any] = {"max_tokens": 8, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"request {n}"}]
    else:
        path, body["prompt"] = "/v1/completions", f"load request {n}"
    t0 = time.monotonic()
    async with http.stream("POST", server.url + path, json=body, headers=server.headers) as r:
        if r.status_code != 200:
            st.errors.append(assert_error_body(json.loads(await r.aread()), r.status_code))
            return
        events = await read_sse(r)
    assert events[-1] == "[DONE]", events[-3:]
    for e in events[:-1]:
        if "error" in e:
            st.errors.append(assert_error_body(e, e["error"]["code"]))
            return
    assert events[-2]["usage"]["completion_tokens"] == 8, events[-2]
    st.completed += 1
    st.tokens += 8
    st.latencies.append(time.monotonic() - t0)


async def load_client(
    server: Server, http: httpx.AsyncClient, cid: int, end: float, st: LoadStats
) -> None:
    n = 0
    while time.monotonic() < end:
        try:
            await asyncio.wait_for(
                one_load_request(http, server, cid * 100_000 + n, st), REQUEST_TIMEOUT_S
            )
        except asyncio.TimeoutError:
            st.hangs += 1
        n += 1


async def run_load(server: Server, clients: int, seconds: float) -> LoadStats:
    st = LoadStats()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as http:
        end = time.monotonic() + seconds
        await asyncio.gather(*(load_client(server, http, i, end, st) for i in range(clients)))
    return st


def test_load_64_streaming_clients(main_server: Server) -> None:
    t0 = time.monotonic()
    st = asyncio.run(run_load(main_server, LOAD_CLIENTS, LOAD_S))
    wall = time.monotonic() - t0
    total = st.completed + len(st.errors) + st.hangs
    print(
        f"\nload: {LOAD_CLIENTS} streaming clients for {wall:.1f} s: {total} requests, "
        f"{st.completed} completed, {len(st.errors)} errors, {st.hangs} hangs; "
        f"{st.tokens} tokens ({st.tokens / wall:.0f} tok/s); latency p50 "
        f"{percentile(st.latencies, 0.5):.3f} s, p99 {percentile(st.latencies, 0.99):.3f} s"
    )
    for message in st.errors[:5]:
        print(f"load error: {message}")
    assert st.hangs == 0
    assert st.completed >= LOAD_CLIENTS  # every client got at least one answer's worth
    assert wall < LOAD_S + REQUEST_TIMEOUT_S + 5
    assert_idle(main_server)
    assert_serves(main_server)


# -------------------------------------------------------------- disconnects
async def disconnect_one(http: httpx.AsyncClient, server: Server, i: int) -> str:
    """Start a long stream and walk away; returns when (in the stream) it left."""
    body = {"prompt": f"disconnect {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
    req = http.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers)
    if i % 5 == 0:  # cut off at 50-150 ms, wherever the request is (often before its headers)
        try:
            await asyncio.wait_for(_open_and_wait(req), 0.05 + (i % 3) * 0.05)
        except asyncio.TimeoutError:
            return "cancelled at 50-150 ms"
        return "after the whole answer"
    async with req as r:
        assert r.status_code == 200
        if i % 5 == 1:
            return "after headers"
        events = await read_sse(r, stop_after=i % 5 - 1)
        assert all(isinstance(e, dict) and "choices" in e for e in events), events
        return f"after {len(events)} chunks"


async def _open_and_wait(req: Any) -> None:
    async with req as r:
        await r.aread()


async def run_disconnects(server: Server, n: int) -> dict[str, int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as http:
        jobs = [asyncio.wait_for(disconnect_one(http, server, i), 60) for i in range(n)]
        outcomes = await asyncio.gather(*jobs)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return counts


def test_200_disconnects_free_all_kv(main_server: Server) -> None:
    before = finished(main_server)
    counts = asyncio.run(run_disconnects(main_server, DISCONNECT_CLIENTS))
    t0 = time.monotonic()
    m = wait_idle(main_server, 10.0)
    took = time.monotonic() - t0
    kv = m["medha:kv_cache_usage_perc"]
    print(f"\ndisconnects: {DISCONNECT_CLIENTS} clients {counts}; KV {kv} after {took:.2f} s")
    assert sum(counts.values()) == DISCONNECT_CLIENTS
    assert counts.get("after 3 chunks", 0) > 0 and counts.get("after headers", 0) > 0
    assert m["medha:kv_cache_usage_perc"] == 0.0
    assert m["medha:num_requests_running"] == 0 and m["medha:num_requests_waiting"] == 0
    assert took < 5.0, f"KV took {took:.1f} s to come back"
    # the requests were aborted, not run to their 200 tokens
    after = finished(main_server)
    ran = sum(after[r] - before[r] for r in ("stop", "length"))
    assert ran < DISCONNECT_CLIENTS / 2
    aborted = after["abort"] - before["abort"]  # each abort counted once
    assert DISCONNECT_CLIENTS / 2 <= aborted <= DISCONNECT_CLIENTS - ran
    assert_serves(main_server)


# ------------------------------------------------------------ malformed input
JSON = {"Content-Type": "application/json"}
BAD_INPUT = [
    # (name, path, httpx kwargs, status, a piece of the message)
    ("invalid json", "/v1/completions", {"content": b'{"prompt": "hi",', "headers": JSON}, 400,
     "the request body is not valid JSON"),
    ("prompt is a number", "/v1/completions", {"json": {"prompt": 5}}, 400, "prompt"),
    ("max_tokens is a string", "/v1/completions",
     {"json": {"prompt": "hi", "max_tokens": "ten"}}, 400, "max_tokens"),
    ("messages not a list", "/v1/chat/completions", {"json": {"messages": "hi"}}, 400,
     "messages"),
    ("messages empty", "/v1/chat/completions", {"json": {"messages": []}}, 400, "messages"),
    ("negative max_tokens", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": -5}},
     400, "max_tokens"),
    ("negative max_tokens (chat)", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}}, 400,
     "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 10**12}},
     400, "maximum context length is 256 tokens"),
    ("huge max_tokens (chat)", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}}, 400,
     "maximum context length is 256 tokens"),
    ("empty prompt", "/v1/completions", {"json": {"prompt": ""}}, 400, "empty"),
    ("empty token list", "/v1/completions", {"json": {"prompt": []}}, 400, "empty"),
    ("prompt over the context", "/v1/completions", {"json": {"prompt": "word " * 300}}, 400,
     "This model's maximum context length is 256 tokens"),
    ("chat over the context", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": "x" * 400}]}}, 400,
     "This model's maximum context length is 256 tokens"),
    ("invalid UTF-8", "/v1/completions",
     {"content": b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}', "headers": JSON}, 400,
     "not valid UTF-8"),
    ("body is not an object", "/v1/completions", {"json": ["hi"]}, 400, "body"),
]  # fmt: skip
# A 10 MB body is answered 413 before it is read, so a client that insists on
# sending all of it races the server's close (the unread bytes make the kernel
# reset the connection, and the answer may be lost): it is tested below over a
# raw socket, which reads the answer, and as a chunked upload.


@pytest.mark.parametrize(
    ("name", "path", "kw", "status", "text"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT]
)
def test_bad_input_is_4xx(
    main_server: Server, name: str, path: str, kw: dict, status: int, text: str
) -> None:
    kw = dict(kw)
    headers = {**main_server.headers, **kw.pop("headers", {})}
    t0 = time.monotonic()
    r = httpx.post(f"{main_server.url}{path}", headers=headers, timeout=30, **kw)
    took = time.monotonic() - t0
    print(f"\nbad input {name!r}: {r.status_code} in {took:.3f} s: {r.text[:160]}")
    assert r.status_code == status, r.text
    assert text in assert_error_body(r.json(), status)
    assert took < 5.0
    assert_serves(main_server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_ignored(main_server: Server, path: str) -> None:
    # as OpenAI and vLLM do: an unknown field is accepted and has no effect
    body: dict[str, Any] = {"max_tokens": 3, "no_such_field": {"x": 1}, "temperature": 0}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi", "name_extra": 1}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(f"{main_server.url}{path}", json=body, headers=main_server.headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_oversized_body_is_refused_before_it_is_read(main_server: Server) -> None:
    """A 10 MB Content-Length gets 413 at once, with almost all of the body still unsent."""
    port = int(main_server.url.rsplit(":", 1)[1])
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        "Content-Length: 10000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode() + b'{"prompt": "')
        raw = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            raw += chunk
    answer = raw.decode()
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert "larger than the server's limit" in answer


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_oversized_chunked_body_is_cut_off(main_server: Server) -> None:
    """Without a Content-Length the server stops keeping the body once the limit is passed."""
    peak = peak_rss_mb(main_server.proc.pid)
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(160):  # 10 MB in 64 KiB chunks
            sent += 65536
            yield b"a" * 65536

    try:
        r = httpx.post(
            f"{main_server.url}/v1/completions",
            content=chunks(),
            headers={**main_server.headers, **JSON},
            timeout=30,
        )
    except httpx.TransportError as exc:  # the server may close before the upload ends
        print(f"\nchunked 10 MB body: connection closed after {sent} bytes ({exc!r})")
        assert sent < 10_000_000
    else:
        print(f"\nchunked 10 MB body: {r.status_code} after {sent} bytes sent: {r.text[:120]}")
        assert r.status_code == 413, r.text[:200]
        assert "larger than the server's limit" in assert_error_body(r.json(), 413)
    grew = peak_rss_mb(main_server.proc.pid) - peak
    print(f"peak RSS of the HTTP process grew by {grew:.1f} MB")
    assert grew < 16, f"the server's peak memory grew by {grew:.0f} MB for a refused body"
    assert_serves(main_server)


# ----------------------------------------------------------- memory pressure
POOL, CONTEXT = 128, 64  # KV tokens in the pool (8 blocks of 16); the context limit
# 12 x 64 tokens (4 blocks each) vs 8 blocks: with 6, the engine's faster steps (no
# thread hand-off) sometimes ran them two at a time without a preemption
PRESSURE_N, PROMPT_LEN, NEW_TOKENS = 12, 16, 48


def pressure_body(i: int) -> dict[str, Any]:
    prompt = [(7 * i + 3 * k) % 200 + 1 for k in range(PROMPT_LEN)]
    return {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


async def send_all(server: Server, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """Every body at once, over connections opened beforehand (so they arrive together)."""
    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(http.get(f"{server.url}/health") for _ in bodies))
        url = f"{server.url}/v1/completions"
        return await asyncio.gather(*(http.post(url, json=b) for b in bodies))


def test_memory_pressure_preempts_and_keeps_outputs() -> None:
    server = start_server("--max-model-len", str(CONTEXT), "--kv-cache-tokens", str(POOL))
    try:
        bodies = [pressure_body(i) for i in range(PRESSURE_N)]
        t0 = time.monotonic()
        together = asyncio.run(send_all(server, bodies))
        took = time.monotonic() - t0
        assert [r.status_code for r in together] == [200] * len(bodies)
        m = wait_idle(server, 5.0)
        preemptions = m["medha:num_preemptions_total"]
        alone = [httpx.post(f"{server.url}/v1/completions", json=b, timeout=60) for b in bodies]
        same = sum(
            a.json()["choices"][0]["text"] == t.json()["choices"][0]["text"]
            for a, t in zip(alone, together, strict=True)
        )
        print(
            f"\nmemory pressure: {len(bodies)} requests of {PROMPT_LEN}+{NEW_TOKENS} tokens "
            f"on a {POOL}-token pool "
            f"in {took:.2f} s: {preemptions:.0f} preemptions, {same}/{len(bodies)} outputs "
            "identical to the request sent alone"
        )
        assert preemptions > 0
        assert all(r.json()["usage"]["completion_tokens"] == NEW_TOKENS for r in together)
        assert same == len(bodies)
        # a request that can never fit is refused at once: the context limit bounds the pool
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": list(range(1, 41)), "max_tokens": 40},
            timeout=10,
        )
        assert r.status_code == 400
        assert f"maximum context length is {CONTEXT} tokens" in assert_error_body(r.json(), 400)
        assert_idle(server)
        assert_serves(server)
    finally:
        stop_server(server)


def test_context_larger_than_pool_is_refused_at_start() -> None:
    """A configuration where one request cannot fit the pool never starts serving."""
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", "1"]
    cmd += ["--max-model-len", "256", "--kv-cache-tokens", "128", "--log-level", "warning"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "max_model_len=256 does not fit" in out.stderr, out.stderr[-2000:]


def test_prompt_longer_than_memory_admits_is_a_400_streaming_too() -> None:
    """A 2,048-token pool gives a 2,048-token context, but the scheduler keeps a few
    blocks free, so the longest prompt it admits is shorter: a prompt in between got
    HTTP 200 and an error event when streamed. Now the server refuses it with a 400
    before anything is submitted, streamed or not, and says the longest prompt."""
    cost = ("--cost-model", "affine:base=0.01,per_token=0.0001,per_attn=0")
    server = start_server("--max-model-len", "2048", *cost)
    try:
        prompt = [5] * 2040
        for stream in (True, False):
            body = {"prompt": prompt, "max_tokens": 1, "stream": stream}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 400, r.text[:500]
            message = assert_error_body(r.json(), 400)
            assert "2040 input tokens" in message and "longest prompt" in message, message
        ok = {"prompt": [5] * 1900, "max_tokens": 2, "stream": True}
        r = httpx.post(f"{server.url}/v1/completions", json=ok, timeout=60)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]
        assert '"error"' not in r.text
        assert_idle(server)
    finally:
        stop_server(server)


def test_a_request_the_engine_refuses_counts_as_no_finished_request() -> None:
    """The engine refuses a prompt the front cannot judge (here: one whose last chunk
    alone would exceed a 50 ms budget on a steep cost model): a 400, streamed or not.
    Such a request never ran, but it was counted in
    ``medha:request_success{finished_reason="abort"}``; now no counter moves."""
    cost = ("--cost-model", "affine:base=0.01,per_token=0.0001,per_attn=0.00001")
    server = start_server(*cost, "--target-batch-time", "0.05")
    try:
        before = finished(server)
        for stream in (False, True):
            body = {"prompt": [5] * 200, "max_tokens": 1, "stream": stream}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
            text = r.text
            assert "the longest prompt this configuration can prefill" in text, text[:500]
        after = finished(server)
        assert after == before, (before, after)
        r = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": [5] * 20, "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 200, r.text
        assert finished(server)["length"] == before["length"] + 1
        assert_idle(server)
    finally:
        stop_server(server)


async def stream_while_big_request(server: Server, big: bytes) -> tuple[float, float]:
    """Stream a long answer; once it flows, send ``big`` (a JSON body) and wait for its
    answer. Returns (the longest gap between the stream's chunks around the big
    request, seconds the big request took)."""
    stamps: list[float] = []
    flowing = asyncio.Event()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:

        async def stream() -> None:
            body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            async with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.monotonic())
                        if len(stamps) >= 5:
                            flowing.set()

        task = asyncio.create_task(stream())
        await asyncio.wait_for(flowing.wait(), 30)
        t0 = time.monotonic()
        headers = {"Content-Type": "application/json"}
        r = await http.post(f"{server.url}/v1/completions", content=big, headers=headers)
        t1 = time.monotonic()
        assert r.status_code == 400, r.text[:300]  # far over the context, as it should be
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task
    before = [t for t in stamps if t < t0][-1:]
    after = [t for t in stamps if t > t1][:1]
    around = before + [t for t in stamps if t0 <= t <= t1] + after
    assert before and after, "the stream ended before the big request did"
    return max(b - a for a, b in itertools.pairwise(around)), t1 - t0


def test_a_huge_prompt_does_not_stall_other_streams() -> None:
    """A 4 MB prompt takes seconds to tokenize; done on the event loop, every other
    stream stood still for that long (3.5 s on the tiny model). The tokenizer runs on a
    worker thread now (it releases the GIL): the other streams go on."""
    flags = ("--max-model-len", "4096", "--kv-cache-tokens", "8192")
    server = start_server(*flags, "--max-body-bytes", "8000000")
    try:
        big = json.dumps({"prompt": "a." * 2_000_000, "max_tokens": 1}).encode()
        gap, took = asyncio.run(stream_while_big_request(server, big))
        print(f"\nhuge prompt: its 400 after {took:.2f} s; longest stream gap {gap:.2f} s")
        assert took > 0.5, took  # heavy enough to show a stall
        assert gap < took / 2, (gap, took)
        assert_serves(server)
    finally:
        stop_server(server)


# ------------------------------------------------------------- killed worker
def worker_pids(server: Server) -> list[int]:
    """The tp workers: forked by the engine's forkserver, below the engine process."""
    tree = descendants(server.proc.pid)
    servers = {p for p, (_, cmd) in tree.items() if "forkserver" in cmd}
    return sorted(p for p, (pp, _) in tree.items() if pp in servers)


async def pending_stream(http: httpx.AsyncClient, server: Server, started: asyncio.Event) -> Any:
    body = {"prompt": "pending", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        events: list[Any] = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()
        return events


async def kill_worker_under_load(server: Server, victim: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(pending_stream(http, server, e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        status = 200
        while status != 503 and time.monotonic() - t0 < 10:
            status = (await http.get(f"{server.url}/health")).status_code
            await asyncio.sleep(0.05)
        to_503 = time.monotonic() - t0
        fresh = await http.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
        pending = await asyncio.wait_for(asyncio.gather(*streams), 10)
    return {"t0": t0, "to_503": to_503, "status": status, "fresh": fresh, "pending": pending}


def test_killed_worker_fails_fast_and_exits() -> None:
    server = start_server("--tp", "2", "--device", "cpu")  # two gloo workers
    try:
        workers = worker_pids(server)
        assert len(workers) == 2, descendants(server.proc.pid)
        everyone = list(descendants(server.proc.pid))
        out = asyncio.run(kill_worker_under_load(server, workers[1]))
        assert out["status"] == 503 and out["to_503"] < 5.0
        fresh = out["fresh"]
        assert fresh.status_code == 503
        assert "the engine" in assert_error_body(fresh.json(), 503)
        for events in out["pending"]:  # each pending stream ends with a 503 error, then [DONE]
            assert events[-1] == "[DONE]"
            assert_error_body(events[-2], 503)
        code = server.proc.wait(timeout=30)
        print(
            f"\nkilled worker: /health 503 after {out['to_503']:.2f} s, server exited "
            f"with code {code} {time.monotonic() - out['t0']:.2f} s after the kill; "
            f"pending stream error: {out['pending'][0][-2]['error']['message'][:120]}"
        )
        assert code == 1
        deadline = time.monotonic() + 10
        while any(alive(p) for p in everyone) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in everyone if alive(p)]
    finally:
        stop_server(server)


def test_worker_killed_while_idle_is_noticed() -> None:
    server = start_server("--tp", "2", "--device", "cpu")  # two gloo workers
    try:
        workers = worker_pids(server)
        assert len(workers) == 2, descendants(server.proc.pid)
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        status = 200
        while status == 200 and time.monotonic() - t0 < 10:
            try:
                status = httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                break  # the server already stopped
            time.sleep(0.05)
        to_503 = time.monotonic() - t0
        code = server.proc.wait(timeout=30)
        print(f"\nidle worker killed: /health {status} after {to_503:.2f} s, exit code {code}")
        assert status != 200 and to_503 < 5.0  # noticed without any request
        assert code == 1
    finally:
        stop_server(server)
