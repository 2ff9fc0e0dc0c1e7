"""A request the engine refuses after the front end admitted it (a check only the
engine process can make) is a 400 JSON error when streamed too, as when not: the
streamed response waits for the engine to accept every sample before it sends
its 200 headers."""

from __future__ import annotations

import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.test_reliability import assert_idle

openai = pytest.importorskip("openai")

#: a steep cost model and a 50 ms budget: a 200-token prompt's last chunk alone
#: would exceed the budget, which only the engine's scheduler knows
STEEP = ("--cost-model", "affine:base=0.01,per_token=0.0001,per_attn=0.00001")
REFUSED = "the longest prompt this configuration can prefill"


@pytest.fixture(scope="module")
def steep():
    server = start_server(*STEEP, "--target-batch-time", "0.05")
    try:
        yield server
    finally:
        stop_server(server)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_refusal_is_a_400_streamed_or_not(steep, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{steep.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        out = client.completions.create(model="tiny", prompt=[5] * 200, max_tokens=1, stream=stream)
        if stream:
            list(out)
    assert info.value.status_code == 400
    assert REFUSED in str(info.value), str(info.value)
    body = info.value.body
    assert isinstance(body, dict) and REFUSED in body["message"], body


def test_a_chat_the_engine_refuses_is_a_400_when_streamed(steep) -> None:
    client = openai.OpenAI(base_url=f"{steep.url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hello " * 30}]
    with pytest.raises(openai.BadRequestError, match=REFUSED) as info:
        list(
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=1, stream=True
            )
        )
    assert info.value.status_code == 400
    assert_idle(steep)


def test_one_refused_sample_of_several_prompts_refuses_the_stream(steep) -> None:
    """Two prompts: the short one is accepted (and aborted), the long one refused."""
    client = openai.OpenAI(base_url=f"{steep.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=REFUSED):
        list(
            client.completions.create(
                model="tiny", prompt=[[5] * 3, [5] * 200], max_tokens=4, n=2, stream=True
            )
        )
    assert_idle(steep)


def test_an_accepted_stream_still_flows(steep) -> None:
    client = openai.OpenAI(base_url=f"{steep.url}/v1", api_key="x", max_retries=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=[5] * 3,
            max_tokens=4,
            n=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons.count("length") == 2, reasons
    assert len(reasons) == 2 * 4  # a chunk per token of each sample
    assert_idle(steep)


def test_stop_strings_without_a_tokenizer_are_a_400_streamed_or_not(tmp_path) -> None:
    from medha_runtime.model.tiny import save_tiny

    model = save_tiny(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    server = start_server(model=str(model))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="stop strings need one"):
                out = client.completions.create(
                    model=str(model), prompt=[5, 6, 7], max_tokens=2, stop=["x"], stream=stream
                )
                if stream:
                    list(out)
        assert_idle(server)
    finally:
        stop_server(server)
