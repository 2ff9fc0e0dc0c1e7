"""A request whose token cannot be sampled fails alone: a 500 naming the cause (an
error event then ``[DONE]`` when streamed); the server stays healthy and serves the
others. The model is tiny with a NaN embedding row (``tests/runtime/poisoned.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.runtime.poisoned import POISON, save_poisoned
from tests.server.conftest import Server, start_server, stop_server

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TIMEOUT = 30.0
CAUSE = "probability tensor contains either"
CLEAN = {"prompt": "hello there", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
#: ``~`` (the poisoned token) in the prompt: its first token fails
IN_PROMPT = {"prompt": "hi ~ there", "max_tokens": 8, "temperature": 1.0}
#: draws ``~`` first, so its second token (a decode) fails
DRAWS_POISON = {
    "prompt": "hello",
    "max_tokens": 8,
    "temperature": 1.0,
    "logit_bias": {str(POISON): 100},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = save_poisoned(tmp_path_factory.mktemp("poisoned"))
    s = start_server(model=str(path))
    yield s
    stop_server(s)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)


def errors_counted(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "medha:request_success_total" and s.labels["finished_reason"] == "error":
                return s.value
    raise AssertionError("no medha:request_success_total{finished_reason='error'}")


def model(server: Server) -> str:
    return client(server).models.list().data[0].id


def complete(server: Server, body: dict) -> str:
    kw = {k: v for k, v in body.items() if k != "ignore_eos"}
    extra = {"ignore_eos": body["ignore_eos"]} if "ignore_eos" in body else None
    out = client(server).completions.create(model=model(server), extra_body=extra, **kw)
    return out.choices[0].text


@pytest.mark.parametrize("bad", [IN_PROMPT, DRAWS_POISON], ids=["in-prompt", "drawn"])
def test_an_unsampleable_request_is_a_500_and_the_others_are_served(server, bad) -> None:
    want = complete(server, CLEAN)
    before = errors_counted(server)
    with ThreadPoolExecutor(3) as pool:
        failing = pool.submit(complete, server, bad)
        clean = [pool.submit(complete, server, CLEAN) for _ in range(2)]
        with pytest.raises(openai.InternalServerError) as info:
            failing.result()
        assert [c.result() for c in clean] == [want, want]
    assert info.value.status_code == 500
    error = info.value.body
    assert CAUSE in error["message"] and "Traceback" not in error["message"]
    assert error["type"] == "InternalServerError"
    assert errors_counted(server) == before + 1
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert complete(server, CLEAN) == want


def test_a_streamed_unsampleable_request_gets_an_error_event_then_done(server) -> None:
    body = {**DRAWS_POISON, "model": model(server), "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == "~"  # the poisoned token, drawn first
    error = chunks[-1]["error"]
    assert error["code"] == 500 and CAUSE in error["message"]
    # the openai client raises it; the server then serves the next request
    stream = client(server).completions.create(**body)
    with pytest.raises(openai.APIError, match=CAUSE):
        for _ in stream:
            pass
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert complete(server, CLEAN)
