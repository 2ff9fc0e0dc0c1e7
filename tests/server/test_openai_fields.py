"""The OpenAI fields beyond the basics, with the ``openai`` client against a started server.

Sampling extras change the output as they should, ``n`` and ``echo`` and
``prompt_logprobs`` give OpenAI's (and vLLM's) shapes, fields Medha lacks
are refused with a 400 naming them, a client that leaves aborts its request,
SIGTERM ends in-flight requests and exits 0, and the HTTP process holds no
torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, Server, start_server, stop_server

torch = pytest.importorskip("torch")

PROMPT = "hi"
#: a fixed cost model: no start-up calibration
COST = ("--cost-model", "affine:base=0.01,per_token=0.0001,per_attn=0")


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve") / "server.log"


@pytest.fixture(scope="module")
def server(log_path: Path) -> Iterator[Server]:
    """conftest's server, logging at info into ``log_path``; the SIGTERM test (the last
    to use it) stops it."""
    with open(log_path, "w") as log:
        s = start_server(*COST, api_key=API_KEY, stderr=log, log_level="info")
        try:
            yield s
        finally:
            stop_server(s)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=60, max_retries=0)


def token_ids(server: Server, **kw: Any) -> list[int]:
    """The generated token ids of one completion of ``PROMPT`` (greedy unless ``kw`` says)."""
    extra = {"return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
    kw = {"temperature": 0, "max_tokens": 24, **kw}
    r = client(server).completions.create(
        model="tiny", prompt=PROMPT, logprobs=0, extra_body=extra, **kw
    )
    return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]


def repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


# ---------------------------------------------------------------- sampling
def test_logit_bias_forces_a_token(server: Server) -> None:
    greedy = token_ids(server, max_tokens=6)
    assert set(greedy) != {72}
    assert token_ids(server, max_tokens=6, logit_bias={"72": 100}) == [72] * 6
    # a strong negative bias removes the greedy first token
    assert token_ids(server, max_tokens=1, logit_bias={str(greedy[0]): -100})[0] != greedy[0]


def test_penalties_reduce_repeats(server: Server) -> None:
    greedy = token_ids(server)
    assert repeats(greedy) >= 3  # the tiny model repeats itself
    assert repeats(token_ids(server, extra_body={"repetition_penalty": 2.0})) < repeats(greedy)
    assert repeats(token_ids(server, frequency_penalty=2.0)) < repeats(greedy)


def test_min_p_one_is_greedy(server: Server) -> None:
    greedy = token_ids(server)
    assert token_ids(server, temperature=1.0, extra_body={"min_p": 1.0}) == greedy


def test_n_gives_choices_reproducible_with_seed(server: Server) -> None:
    c = client(server)

    def run() -> Any:
        return c.completions.create(
            model="tiny", prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=7
        )

    a, b = run(), run()
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    texts = [ch.text for ch in a.choices]
    assert texts == [ch.text for ch in b.choices]
    assert len(set(texts)) > 1  # each sample has its own seed stream
    one = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7)
    assert one.choices[0].text == texts[0]
    # OpenAI's counting: the prompt once, every choice's tokens
    assert a.usage.prompt_tokens == one.usage.prompt_tokens
    assert a.usage.completion_tokens == 3 * 8


def test_echo_with_logprobs(server: Server) -> None:
    r = client(server).completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    ch = r.choices[0]
    assert ch.text.startswith("Hello")
    lp = ch.logprobs
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[1 : r.usage.prompt_tokens]) == "Hello"  # after BOS
    assert lp.text_offset == sorted(lp.text_offset)


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_are_the_models_whatever_the_sampling(server: Server) -> None:
    """``top_k=2`` at temperature 0.5: the top 5 logprobs are the model's own (the
    processed distribution gave the 3rd to 5th -inf, which the stream wrote as
    ``-Infinity``, not JSON, and the plain answer as ``null``), streamed or not, in
    completions and chat."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "top_k": 2, "logprobs": 5}
    body |= {"temperature": 0.5, "seed": 3, "return_tokens_as_token_ids": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        plain = _strict_json(http.post("/v1/completions", json=body).text)["choices"][0]
        lines = http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
        events = [_strict_json(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
        chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]}
        chat |= {"max_tokens": 2, "top_k": 2, "logprobs": True, "top_logprobs": 5}
        chat = _strict_json(http.post("/v1/chat/completions", json=chat).text)["choices"][0]
    ids = [256, *PROMPT.encode()]  # the tiny tokenizer: BOS, then bytes
    out = [int(t.split(":")[1]) for t in plain["logprobs"]["tokens"]]
    want = teacher_forced(ids + out[:1])[-2:]  # the rows that predicted the two tokens
    streamed = [t for e in events for t in e["logprobs"]["top_logprobs"]]
    assert streamed == plain["logprobs"]["top_logprobs"]
    # the same fp32 model, batched differently: errors of a few fp32 ulps of the largest value
    tol = 64 * torch.finfo(torch.float32).eps * float(want.abs().max())
    for top, row in zip(plain["logprobs"]["top_logprobs"], want, strict=True):
        got = {int(k.split(":")[1]): v for k, v in top.items()}
        values, best = row.topk(5)
        assert sorted(got) == sorted(best.tolist())
        for tok, v in zip(best.tolist(), values.tolist(), strict=True):
            assert abs(got[tok] - v) <= tol, (tok, got[tok], v)
    for tok in chat["logprobs"]["content"]:
        assert all(t["logprob"] > -100 for t in tok["top_logprobs"]), tok


def test_echo_keeps_prompt_logprobs_to_their_own_top(server: Server) -> None:
    """``echo`` with ``logprobs=3`` and ``prompt_logprobs=0``: each prompt token's entry
    holds that token only (it held the 3 alternatives ``echo`` asked the engine for)."""
    r = client(server).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=3,
        extra_body={"prompt_logprobs": 0},
    )
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == r.usage.prompt_tokens
    assert all(len(e) == 1 for e in pl[1:]), pl
    assert all(len(t) >= 3 for t in r.choices[0].logprobs.top_logprobs[1:])  # echo's top 3


def teacher_forced(ids: list[int]) -> torch.Tensor:
    """fp64 ``log_softmax`` of the tiny model's logits at every position, in one pass."""
    from medha_runtime.model import ForwardBatch, load_model

    model, _ = load_model("tiny", dtype="float32")
    blocks = -(-len(ids) // 16)
    kv = model.allocate_kv_cache(blocks, 16)
    batch = ForwardBatch.build([ids], [0], [list(range(blocks))], block_size=16, sample=[True])
    batch = dataclasses.replace(batch, sample_rows=torch.arange(len(ids)))
    with torch.no_grad():
        return torch.log_softmax(model(batch, kv).double(), dim=-1)


def test_prompt_logprobs_equal_a_teacher_forced_forward(server: Server) -> None:
    text = "The quick brown fox jumps"
    r = client(server).completions.create(
        model="tiny", prompt=text, max_tokens=1, extra_body={"prompt_logprobs": 3}
    )
    pl = r.choices[0].model_extra["prompt_logprobs"]
    ids = [256, *text.encode()]  # the tiny tokenizer: BOS, then bytes
    assert len(pl) == len(ids) and pl[0] is None
    want = teacher_forced(ids)
    got = torch.tensor([e[str(t)]["logprob"] for e, t in zip(pl[1:], ids[1:], strict=True)])
    ref = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    # the same fp32 model, batched differently: errors of a few fp32 ulps of the largest value
    tol = 64 * torch.finfo(torch.float32).eps * float(ref.abs().max())
    assert float((got.double() - ref).abs().max()) <= tol
    for e, row in zip(pl[1:], want[:-1], strict=True):  # the top 3 are the model's top 3
        top = sorted(
            ((int(k), v) for k, v in e.items() if v["rank"] is not None and v["rank"] <= 3),
            key=lambda kv: kv[1]["rank"],
        )
        assert [k for k, _ in top] == row.topk(3).indices.tolist()


def _stream_chunks(server: Server, stream_options: dict) -> list:
    """The chunks of a streamed 5-token greedy completion of PROMPT."""
    stream = client(server).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options=stream_options,
    )
    return list(stream)


def test_continuous_usage_stats(server: Server) -> None:
    chunks = _stream_chunks(server, {"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    # without include_usage, no usage at all (vLLM's rule); it was in every chunk
    chunks = _stream_chunks(server, {"continuous_usage_stats": True})
    assert chunks and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_top_logprobs_keyed_by_each_token(server: Server) -> None:
    r = client(server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    for pos in r.choices[0].logprobs.content:
        names = [t.token for t in pos.top_logprobs]
        assert len(names) == len(set(names)) == 5  # no two tokens share a key
        assert pos.token == names[0]  # greedy: the chosen token heads its own list
        for t in [pos, *pos.top_logprobs]:
            if t.token.startswith("bytes:"):  # part of a character: its real byte
                assert t.bytes == [int(t.token[len("bytes:\\x") :], 16)]
            else:
                assert bytes(t.bytes).decode() == t.token


# ---------------------------------------------------------------- refusals
REFUSED = [
    ("tools", "chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("response_format", "chat", {"response_format": {"type": "json_object"}}),
    ("image_url", "chat",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("content", "chat", {"messages": [{"role": "user"}]}),
    ("suffix", "completions", {"suffix": "end"}),
    ("best_of", "completions", {"best_of": 3}),
    ("use_beam_search", "completions", {"use_beam_search": True}),
    ("stream_options", "completions", {"stream_options": {"include_usage": True}}),
    ("logit_bias", "completions", {"logit_bias": {"H": 5}}),
    ("top_logprobs", "chat", {"top_logprobs": 2}),
]  # fmt: skip


@pytest.mark.parametrize(("field", "route", "body"), REFUSED, ids=[r[0] for r in REFUSED])
def test_fields_we_lack_are_refused(server: Server, field: str, route: str, body: dict) -> None:
    c = client(server)
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            kw = {"messages": [{"role": "user", "content": "hi"}], **body}
            messages = kw.pop("messages")
            c.chat.completions.create(**base, messages=messages, extra_body=kw)
        else:
            c.completions.create(**base, prompt=PROMPT, extra_body=body)
    assert field in err.value.body["message"]
    param = {"image_url": "messages[0].content[0].type", "role": "messages[0].role"}
    param["content"] = "messages[0].content"
    assert err.value.body["param"] == param.get(field, field)


def test_only_the_served_name_is_accepted(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="tiny-other", prompt=PROMPT, max_tokens=1)


# ---------------------------------------------------------- disconnects, exit
def finished(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "medha:request_success_total":
                out[s.labels["finished_reason"]] = s.value
            elif s.name == "medha:kv_cache_usage_perc":
                out["kv"] = s.value
    return out


def test_non_streaming_disconnect_frees_kv_and_counts_an_abort(server: Server) -> None:
    """A client that goes away while the engine runs its request.

    One request of 250 tokens runs in ~0.22 s on tiny, less than the engine's 0.25 s
    heartbeat, so it could finish before the test sees it in the engine (CI met that
    once). ``n=128`` samples of 253 tokens need 32,384 KV tokens, 16 times the 2,048-token
    pool: they run in at least 16 rounds, and the socket closes in the first (with
    ``n=32``, four rounds, a loaded CI machine once closed it after the last: 32 lengths).
    """
    before = finished(server)
    sock = _orphan(int(server.url.rsplit(":", 1)[1]), stream=False, max_tokens=250, n=128)
    try:
        _wait_in_engine(server, 1, at_least=True)
    finally:
        sock.close()
    left = time.monotonic()
    while True:
        now = finished(server)
        ended = now["abort"] + now["length"] - before["abort"] - before["length"]
        if ended == 128 and now["kv"] == 0.0:
            break
        assert time.monotonic() - left < 10.0, f"not ended 10 s after the disconnect: {now}"
        time.sleep(0.02)
    # the samples still running or waiting when the client left count as aborts
    assert now["abort"] - before["abort"] >= 8, (before, now)


def _orphan(port: int, stream: bool, max_tokens: int = 200, n: int = 1) -> socket.socket:
    """A request (``n`` samples) whose client never reads its answer."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    body = json.dumps({**body, "n": n}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def _wait_in_engine(
    server: Server, count: int, timeout_s: float = 30.0, at_least: bool = False
) -> None:
    """Until the engine's heartbeat counts ``count`` (or ``at_least``: ``count`` or more)
    requests, running or waiting."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        seen = sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name in ("medha:num_requests_running", "medha:num_requests_waiting")
        )
        if seen == count or (at_least and seen > count):
            return
        assert time.monotonic() < deadline, f"{seen} requests in the engine, not {count}"
        time.sleep(0.05)


def test_log_lines_and_sigterm_with_orphaned_requests(server: Server, log_path: Path) -> None:
    """Runs last on the module's server: SIGTERM stops it."""
    c = client(server)
    for _ in range(2):  # an unknown field: one warning, whatever the count
        c.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"no_such_field": 1}
        )
    with pytest.raises(openai.BadRequestError):  # a refused field: an access line too
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"suffix": "x"})
    with open(f"/proc/{server.proc.pid}/maps") as maps:  # the HTTP process
        assert "libtorch" not in maps.read()
    port = int(server.url.rsplit(":", 1)[1])
    # 12 requests of 4 samples of 202 tokens need 9,696 KV tokens, almost five times the
    # 2,048-token pool: they run in five or more rounds (~0.2 s each), so requests are
    # still in flight when SIGTERM comes
    socks = [_orphan(port, stream=i % 2 == 1, n=4) for i in range(12)]
    try:
        _wait_in_engine(server, 12, at_least=True)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(timeout=10)
        took = time.monotonic() - t0
    finally:
        for sock in socks:
            sock.close()
    text = log_path.read_text()
    print(f"\nSIGTERM with 12 orphaned requests: exit code {rc} after {took:.2f} s")
    assert rc == 0 and took < 5.0, (rc, took, text[-2000:])
    assert "Traceback" not in text
    assert "serving on http://127.0.0.1" in text and "KV pool" in text  # the start-up block
    assert text.count("'no_such_field'") == 1
    assert "/v1/completions 200 prompt_tokens=" in text  # access lines
    assert "/v1/completions 400 error=suffix: suffix (insertion) is not supported" in text
    aborted = re.search(r"aborted (\d+) in-flight", text)
    assert aborted is not None and 1 <= int(aborted[1]) <= 48, text[-2000:]  # samples


def test_front_end_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import medha_runtime.cli, medha_runtime.server\n"
        "from medha_runtime.server import app, routes, streams, formatting, tokens\n"
        "from medha_runtime.server.app import ServerConfig, build_app\n"
        "from medha_runtime.server.engine_proc import EngineArgs\n"
        "build_app(ServerConfig(engine=EngineArgs()))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    # the repo first, then the parent's own PYTHONPATH (where fastapi may live), not instead of it
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_port_in_use_is_one_line_before_the_engine_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 1
    want = f"medha-runtime serve: error: cannot listen on 127.0.0.1:{port}: the port is in use\n"
    assert out.stderr == want


def test_sigterm_to_the_process_group_while_busy_with_workers_exits_0(tmp_path: Path) -> None:
    """``systemctl stop`` (KillMode=control-group) or ``kill -TERM -PGID`` while a
    ``--tp 2`` server is busy: the workers die of the signal in mid-step, and the
    engine reported that as a worker failure, so the server exited 1 with "the engine
    died". The engine was told to stop too: now that is a stop, with exit code 0."""
    log_file = tmp_path / "serve.log"
    with open(log_file, "w") as log:
        s = start_server("--tp", "2", "--device", "cpu", *COST, stderr=log, log_level="info")
    socks: list[socket.socket] = []
    try:
        port = int(s.url.rsplit(":", 1)[1])
        socks = [_orphan(port, stream=i % 2 == 0) for i in range(4)]
        _wait_in_engine(s, 4, at_least=True)
        time.sleep(0.2)  # decoding: the workers are in a step
        os.killpg(s.proc.pid, signal.SIGTERM)
        rc = s.proc.wait(timeout=30)
    finally:
        for sock in socks:
            sock.close()
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
    text = log_file.read_text()
    assert rc == 0, text[-3000:]
    assert "engine died" not in text and "Traceback" not in text, text[-3000:]


def test_second_ctrl_c_while_stopping_exits_0_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C twice, the second while in-flight streams are being ended: uvicorn then
    skips the app's lifespan shutdown and cancels it on exit, and starlette logged the
    CancelledError's traceback. Now the engine is stopped all the same, quietly."""
    log_file = tmp_path / "serve.log"
    longer = ("--max-model-len", "4096", "--kv-cache-tokens", "16384")
    with open(log_file, "w") as log:
        s = start_server(*COST, *longer, stderr=log, log_level="info")
    socks: list[socket.socket] = []
    try:
        m = re.search(r"engine process pid (\d+)", log_file.read_text())
        assert m is not None
        engine_pid = int(m.group(1))
        port = int(s.url.rsplit(":", 1)[1])
        # 4,000 tokens each: four 200-token streams could end between two heartbeats
        socks = [_orphan(port, stream=True, max_tokens=4000) for _ in range(4)]
        _wait_in_engine(s, 4, at_least=True)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.03)  # uvicorn is still closing connections: a forced exit
        s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(timeout=15)
    finally:
        for sock in socks:
            sock.close()
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
    text = log_file.read_text()
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{engine_pid}") and _running(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_while_the_engine_starts_exits_0(tmp_path: Path) -> None:
    log_file = tmp_path / "serve.log"
    with open(log_file, "w") as log:
        cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", "0"]
        proc = subprocess.Popen(cmd, stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            while "Waiting for application startup" not in log_file.read_text():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # the engine process is still importing torch
            rc = proc.wait(timeout=10)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log_file.read_text()
    assert rc == 0 and took < 5.0, (rc, took, text)
    assert "stopped while the engine was starting" in text and "Traceback" not in text


@pytest.mark.parametrize("target", ["group", "engine"])
def test_sigterm_to_the_process_group_or_the_engine_stops_cleanly(
    tmp_path: Path, target: str
) -> None:
    """``systemd`` (KillMode=control-group), ``kill -TERM -PGID`` and ``pkill -f`` signal
    the engine process too; it used to stop first, and the server then exited 1 with
    "the engine died (the engine process exited with code 0)". Now the engine says it
    stopped on SIGTERM and the server stops as on its own signal: exit code 0."""
    log_file = tmp_path / "serve.log"
    with open(log_file, "w") as log:
        cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", "0"]
        proc = subprocess.Popen(cmd, stderr=log, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while (m := re.search(r"engine process pid (\d+)", log_file.read_text())) is None:
                assert time.monotonic() < deadline and proc.poll() is None, log_file.read_text()
                time.sleep(0.05)
            if target == "group":
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                os.kill(int(m.group(1)), signal.SIGTERM)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log_file.read_text()
    assert rc == 0, text
    assert "the engine process got SIGTERM: stopping the server" in text
    assert "engine died" not in text and "Traceback" not in text
