"""A ``--tp 2`` server on the CPU (two gloo workers) answers like a ``--tp 1`` server."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import Server, start_server, stop_server

openai = pytest.importorskip("openai")

#: the same fixed cost model on both servers: identical schedules, no start-up calibration
COST = ("--cost-model", "affine:base=0.01,per_token=0.0001,per_attn=0")
PROMPTS = ["hello", "The sky over the port was", "Medha shards the KV cache of long prompts"]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    with ThreadPoolExecutor(2) as pool:
        cpu = (*COST, "--device", "cpu")  # gloo workers on any machine
        futures = [pool.submit(start_server, *cpu, "--tp", str(tp)) for tp in (1, 2)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        yield started[0], started[1]
    finally:
        for s in started:
            stop_server(s)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)


def completion(server: Server, prompt: str, stream: bool) -> tuple[str, int]:
    c = client(server)
    if not stream:
        r = c.completions.create(prompt=prompt, **GREEDY)
        return r.choices[0].text, r.usage.completion_tokens
    chunks = list(
        c.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[
        -1
    ].usage.completion_tokens


def chat(server: Server, prompt: str) -> tuple[str, int]:
    r = client(server).chat.completions.create(
        messages=[{"role": "user", "content": prompt}], **GREEDY
    )
    return r.choices[0].message.content, r.usage.completion_tokens


def test_tp2_completions_match_tp1(servers: tuple[Server, Server]) -> None:
    one, two = servers
    for prompt in PROMPTS:
        want = completion(one, prompt, stream=False)
        assert want[1] == 12 and want[0]
        assert completion(two, prompt, stream=False) == want, prompt
        assert completion(two, prompt, stream=True) == want, prompt


def test_tp2_chat_matches_tp1(servers: tuple[Server, Server]) -> None:
    one, two = servers
    for prompt in PROMPTS[:2]:
        want = chat(one, prompt)
        assert want[1] == 12
        assert chat(two, prompt) == want, prompt


def test_tp2_batch_matches_tp1(servers: tuple[Server, Server]) -> None:
    """Several prompts in one request run in one batch on both servers."""
    one, two = servers
    texts = []
    for s in (one, two):
        r = client(s).completions.create(prompt=PROMPTS, **{**GREEDY, "max_tokens": 6})
        texts.append([c.text for c in sorted(r.choices, key=lambda c: c.index)])
        assert r.usage.completion_tokens == 6 * len(PROMPTS)
    assert texts[0] == texts[1]


def test_tp2_sampling_extras_match_tp1(servers: tuple[Server, Server]) -> None:
    """Penalties, logit_bias, min_p, seeded n=2 and prompt_logprobs run on the last
    stage's sampling rank: the same answers under TP2."""
    extras = {
        "repetition_penalty": 1.5,
        "min_p": 0.05,
        "prompt_logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    answers = []
    for s in servers:
        r = client(s).completions.create(
            model="tiny",
            prompt=PROMPTS[1],
            max_tokens=8,
            n=2,
            seed=3,
            temperature=0.8,
            frequency_penalty=1.0,
            logit_bias={"101": 2.0},
            logprobs=0,
            extra_body=extras,
        )
        answers.append(r)
    one, two = answers
    for a, b in zip(one.choices, two.choices, strict=True):
        assert a.logprobs.tokens == b.logprobs.tokens
        pa, pb = a.model_extra["prompt_logprobs"], b.model_extra["prompt_logprobs"]
        assert pa[0] is None and pb[0] is None and len(pa) == len(pb)
        for ea, eb in zip(pa[1:], pb[1:], strict=True):
            assert ea.keys() == eb.keys()
            for k in ea:
                assert abs(ea[k]["logprob"] - eb[k]["logprob"]) <= 1e-3 * max(
                    1.0, abs(ea[k]["logprob"])
                )
    assert one.choices[0].logprobs.tokens != one.choices[1].logprobs.tokens
