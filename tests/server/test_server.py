"""The OpenAI-compatible server, started for real on the tiny model."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import API_KEY, Server, start_server, stop_server

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TIMEOUT = 30.0


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def client(server: Server) -> openai.OpenAI:
    url = f"{server.url}/v1"
    return openai.OpenAI(base_url=url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def post(server: Server, path: str, **kw: object) -> httpx.Response:
    headers = kw.pop("headers", server.headers)
    return httpx.post(f"{server.url}{path}", headers=headers, timeout=TIMEOUT, **kw)  # type: ignore[arg-type]


def metric(server: Server, name: str) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return None


def test_completion(server: Server) -> None:
    r = client(server).completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client(server).completions.create(
        model="tiny", prompt="hello", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic


def test_completion_token_ids_and_list(server: Server) -> None:
    r = post(server, "/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_chat(server: Server) -> None:
    r = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6 or r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("chat", [False, True])
def test_stream_with_usage(server: Server, chat: bool) -> None:
    c = client(server)
    kw = {"model": "tiny", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    opts = {"include_usage": True}
    if chat:
        stream = c.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options=opts,
            extra_body={"ignore_eos": True},
            **{k: v for k, v in kw.items() if k != "ignore_eos"},
        )
    else:
        stream = c.completions.create(
            prompt="hello",
            stream=True,
            stream_options=opts,
            extra_body={"ignore_eos": True},
            **{k: v for k, v in kw.items() if k != "ignore_eos"},
        )
    chunks = list(stream)
    first = chunks[0]
    # one chunk per token, as soon as it is made: a token whose text is held back
    # (part of a UTF-8 character) comes with empty text
    with_choice = [ch for ch in chunks if ch.choices]
    assert len(with_choice) == 10
    texts = [ch.choices[0].delta.content if chat else ch.choices[0].text for ch in with_choice]
    assert all(t is not None for t in texts) and "".join(texts)
    if chat:
        assert first.choices[0].delta.role == "assistant"
        assert not any(ch.choices[0].delta.role for ch in with_choice[1:])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)


def test_stream_ends_with_done(server: Server) -> None:
    body = {"prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=TIMEOUT
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_models_and_health(server: Server) -> None:
    m = client(server).models.list()
    assert [x.id for x in m.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200


BAD = [
    ("invalid json", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}),
    ("wrong type", {"json": {"prompt": "hi", "max_tokens": "many"}}),
    ("missing prompt", {"json": {"max_tokens": 3}}),
    ("n = 0", {"json": {"prompt": "hi", "n": 0}}),
    ("best_of > n", {"json": {"prompt": "hi", "n": 2, "best_of": 3}}),
    ("negative temperature", {"json": {"prompt": "hi", "temperature": -1}}),
    ("bad top_p", {"json": {"prompt": "hi", "top_p": 0}}),
    ("token out of vocab", {"json": {"prompt": [10**9]}}),
    ("max_tokens too large", {"json": {"prompt": "hi", "max_tokens": 10_000}}),
]


@pytest.mark.parametrize(("name", "kw"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_400(server: Server, name: str, kw: dict) -> None:
    headers = {**server.headers, **kw.pop("headers", {})}
    r = post(server, "/v1/completions", headers=headers, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 400 and err["message"]


def test_out_of_vocab_ids_are_a_400_before_any_stream(server: Server) -> None:
    # the tiny model's vocabulary is 259 tokens; streaming or not, the answer is a 400
    # naming the field (it was a 200 stream holding an error event), and the refused
    # request is not counted as an abort in /metrics (it was)
    before = _aborts(server)
    cases = [
        ("/v1/completions", {"prompt": [1, 10**6]}, "prompt", "token id 1000000"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"300": 5}}, "logit_bias", "300"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"259": 1}},
            "logit_bias",
            "259",
        ),
    ]
    for path, body, param, text in cases:
        for stream in (False, True):
            r = post(server, path, json={**body, "max_tokens": 2, "stream": stream})
            assert r.status_code == 400, (path, body, stream, r.text)
            err = r.json()["error"]
            assert err["param"] == param and text in err["message"], err
            assert "outside the model's vocabulary (0..258)" in err["message"], err
    assert _aborts(server) == before


def _aborts(server: Server) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "medha:request_success_total" and s.labels["finished_reason"] == "abort":
                return s.value
    return None


def test_a_body_that_is_not_sent_as_json_is_named(server: Server) -> None:
    # ``curl -d`` without -H sends application/x-www-form-urlencoded: the 400 says what
    # to send (it said "body: Input should be a valid dictionary or object ...")
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        r = post(
            server,
            "/v1/completions",
            content=body,
            headers={**server.headers, "Content-Type": kind},
        )
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "'Content-Type: application/json'" in message and repr(kind) in message, message
    # a JSON type with parameters is JSON
    kind = "application/json; charset=utf-8"
    r = post(
        server, "/v1/completions", content=body, headers={**server.headers, "Content-Type": kind}
    )
    assert r.status_code == 200, r.text


def test_text_parts_are_joined_one_per_line(server: Server) -> None:
    # as vLLM joins them: "a" and "b" are "a\nb", not "ab"
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    as_parts = post(server, "/tokenize", json={"messages": [{"role": "user", "content": parts}]})
    as_text = post(
        server, "/tokenize", json={"messages": [{"role": "user", "content": "Hello\nworld"}]}
    )
    assert as_parts.status_code == as_text.status_code == 200
    assert as_parts.json()["tokens"] == as_text.json()["tokens"]
    r = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=1
    )
    assert r.usage.prompt_tokens == as_text.json()["count"]


def test_a_sampling_error_names_its_field(server: Server) -> None:
    r = post(server, "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "min_tokens": 5})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_tokens"  # was "min_tokens=5"


def test_an_infinite_slo_is_a_400_naming_the_field(server: Server) -> None:
    # Python's JSON reads Infinity: it reached the engine, whose refusal named the
    # engine request and its own field ("request '...-0': ttft_slo must be > 0, got inf")
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        for stream in ("false", "true"):
            body = f'{{"prompt": "hi", "max_tokens": 2, "stream": {stream}, "{name}": Infinity}}'
            headers = {**server.headers, "Content-Type": "application/json"}
            r = post(server, "/v1/completions", content=body.encode(), headers=headers)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == name and err["message"].startswith(f"{name}: "), err


def test_too_long_prompt(server: Server) -> None:
    r = post(server, "/v1/completions", json={"prompt": list(range(1, 300))})
    assert r.status_code == 400
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length is"):
        client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 400}]
        )


def test_unknown_model_404(server: Server) -> None:
    r = post(server, "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )


def test_api_key(server: Server) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    assert post(server, "/v1/completions", json=body, headers={}).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert post(server, "/v1/completions", json=body, headers=bad).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).status_code == 401
    # /health and /metrics stay open
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).status_code == 200


def test_tokenize_round_trip(server: Server) -> None:
    r = post(server, "/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200
    out = r.json()
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    back = post(server, "/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == "hello world"


def test_metrics_after_request(server: Server) -> None:
    post(server, "/v1/completions", json={"prompt": "hi", "max_tokens": 3}).raise_for_status()
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in (
        "medha:num_requests_running",
        "medha:num_requests_waiting",
        "medha:kv_cache_usage_perc",
        "medha:num_preemptions_total",
        "medha:time_to_first_token_seconds_bucket",
        "medha:inter_token_latency_seconds_count",
        "medha:e2e_request_latency_seconds_count",
        "medha:request_ttft_deadline_total",
    ):
        assert name in names, name
    assert metric(server, "medha:time_to_first_token_seconds_count") >= 1


def test_disconnect_aborts_and_frees_kv(server: Server) -> None:
    body = {"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=TIMEOUT
    ) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
        deadline = time.monotonic() + 5
        while metric(server, "medha:kv_cache_usage_perc") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = metric(server, "medha:kv_cache_usage_perc")
    # the client went away: the engine must abort the request and free its KV
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(server, "medha:kv_cache_usage_perc") == 0 and (
            metric(server, "medha:num_requests_running") == 0
        ):
            break
        time.sleep(0.1)
    assert metric(server, "medha:kv_cache_usage_perc") == 0, f"KV still in use (was {busy})"
    assert metric(server, "medha:request_success_total") is not None


def test_engine_death_gives_503() -> None:
    server = start_server()
    try:
        engine = children(server.proc.pid)
        pids = [p for p in engine if b"spawn" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert pids, "no spawned engine process"
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        status = 200
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=TIMEOUT)
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        # then it stops by itself, with code 1, so that a supervisor restarts it
        assert server.proc.wait(timeout=30) == 1
    finally:
        stop_server(server)
    assert server.proc.returncode is not None


def test_sigterm_leaves_no_process() -> None:
    server = start_server()
    kids = children(server.proc.pid)
    grandkids = [g for k in kids for g in children(k)]
    stop_server(server)
    assert server.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    deadline = time.monotonic() + 5
    while any(alive(p) for p in kids + grandkids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in kids + grandkids)


def test_prefix_cache_hits_give_the_same_greedy_text(server: Server) -> None:
    """A repeated long prompt reuses its cached blocks (usage and the counters say
    so) and gives the tokens its cold run gave: completions and chat."""
    c = client(server)
    queries0 = metric(server, "medha:prefix_cache_queries_total") or 0.0
    hits0 = metric(server, "medha:prefix_cache_hits_total") or 0.0
    doc = "prefix caching test: " + " ".join(f"w{i}" for i in range(20))
    kw = {"model": "tiny", "max_tokens": 5, "temperature": 0}
    cold = c.completions.create(prompt=doc, **kw)
    warm = c.completions.create(prompt=doc, **kw)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < warm.usage.prompt_tokens
    assert warm.choices[0].text == cold.choices[0].text
    messages = [{"role": "user", "content": doc + " chat"}]
    chat_cold = c.chat.completions.create(messages=messages, **kw)
    chat_warm = c.chat.completions.create(messages=messages, **kw)
    assert chat_cold.usage.prompt_tokens_details.cached_tokens == 0
    assert chat_warm.usage.prompt_tokens_details.cached_tokens > 0
    assert chat_warm.choices[0].message.content == chat_cold.choices[0].message.content
    deadline = time.monotonic() + 10.0  # the counters follow the engine's heartbeats
    while time.monotonic() < deadline:
        hits = (metric(server, "medha:prefix_cache_hits_total") or 0.0) - hits0
        if hits >= cached:
            break
        time.sleep(0.2)
    assert hits >= cached
    assert (metric(server, "medha:prefix_cache_queries_total") or 0.0) - queries0 >= hits
