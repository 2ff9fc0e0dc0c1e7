"""The offline API's edges (vLLM's behaviour): interrupted calls, chat prompts,
``max_tokens=None``, ``n``, and messages for bad input."""

from __future__ import annotations

import pytest

from medha_runtime import LLM, SamplingParams
from medha_sched import AffineCostModel

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
#: the first prompt finishes first, while the others are in flight
STAGGERED = [GREEDY.replace(max_tokens=3), GREEDY, GREEDY]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _InterruptingBar:
    """A ``use_tqdm`` callable whose bar raises KeyboardInterrupt at the first update."""

    def __init__(self, **kwargs: object) -> None:
        pass

    def set_postfix_str(self, *args: object, **kwargs: object) -> None:
        pass

    def update(self, n: int) -> None:
        raise KeyboardInterrupt

    def close(self) -> None:
        pass


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layout", [{"async_scheduling": True}, {"spp": 2}], ids=["async", "spp2"])
def test_generate_after_an_interrupted_one_returns_its_own_outputs(layout) -> None:
    """With async scheduling (spp=2 has it on by default), an aborted request still in
    flight finished in a later call's step: that call took it for its own, ended early
    and raised KeyError, leaving its own requests running."""
    with LLM("tiny", cost_model=COST, max_model_len=128) as fresh:
        want = _tokens(fresh.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    with LLM("tiny", cost_model=COST, max_model_len=128, **layout) as llm:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, STAGGERED, use_tqdm=_InterruptingBar)
        for _ in range(2):
            # one prompt: fewer than the requests the interrupted call left in flight
            assert _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == want
        assert not llm.engine.has_unfinished_requests()


def test_chat_output_carries_the_rendered_prompt_text() -> None:
    """vLLM's chat outputs carry the rendered template text as ``prompt``; it was None."""
    messages = [{"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM("tiny", cost_model=COST, max_model_len=256) as llm:
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template(messages, tokenize=False)
        out = llm.chat(messages, params, use_tqdm=False)[0]
        assert out.prompt == text and "hello" in text
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)


def test_max_tokens_none_generates_up_to_the_context_limit() -> None:
    """vLLM reads max_tokens=None as "up to the context limit"; it was refused."""
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, min_tokens=3)
    assert params.max_tokens is None
    with LLM("tiny", cost_model=COST, max_model_len=48) as llm:
        out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 48 - 4 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_n_completions_per_prompt_are_requests_of_their_own() -> None:
    """vLLM's ``n``: one RequestOutput per prompt holding n completions (seed + i each
    where a seed is given, as the server does); it was an unknown keyword."""
    prompts = [[5, 6, 7], [8, 9]]
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=7)
    with LLM("tiny", cost_model=COST, max_model_len=128) as llm:
        outs = llm.generate(prompts, sampled.replace(n=3), use_tqdm=False)
        assert [len(o.outputs) for o in outs] == [3, 3]
        for prompt, out in zip(prompts, outs, strict=True):
            assert [c.index for c in out.outputs] == [0, 1, 2]
            assert out.prompt_token_ids == prompt
            for i, c in enumerate(out.outputs):
                alone = llm.generate([prompt], sampled.replace(seed=7 + i), use_tqdm=False)
                assert c.token_ids == alone[0].outputs[0].token_ids
        unseeded = llm.generate([[5, 6, 7]], sampled.replace(seed=None, n=3), use_tqdm=False)
        assert len({tuple(c.token_ids) for c in unseeded[0].outputs}) == 3
        chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY.replace(n=2), use_tqdm=False)
        first, second = chat[0].outputs
        assert (first.index, second.index) == (0, 1) and first.token_ids == second.token_ids
        with pytest.raises(ValueError, match=r"n=2: LLMEngine\.add_request"):
            llm.engine.add_request([5, 6], GREEDY.replace(n=2))
        assert not llm.engine.has_unfinished_requests()
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"n must be an integer >= 1, got {bad!r}"):
            SamplingParams(n=bad)


def test_bad_offline_input_gets_messages_naming_it() -> None:
    """A dict of params was named by its first key; a non-string 'prompt' was called
    missing; a seed beyond 64 bits was reduced silently; stop_token_ids outside the
    vocabulary and more than 20 logprobs (the whole vocabulary) were accepted."""
    with LLM("tiny", cost_model=COST, max_model_len=64) as llm:
        vocab = llm.engine.config.vocab_size
        with pytest.raises(ValueError, match=r"got a dict \(\{'max_tokens': 3\}\).*SamplingParams"):
            llm.generate(["a", "b"], {"max_tokens": 3}, use_tqdm=False)
        with pytest.raises(ValueError, match="got a dict"):
            llm.generate(["a", "b"], [{"max_tokens": 3}, GREEDY], use_tqdm=False)
        with pytest.raises(ValueError, match="prompt 0: 'prompt' must be a string, got 5"):
            llm.generate({"prompt": 5}, GREEDY, use_tqdm=False)
        bad_stop = GREEDY.replace(stop_token_ids=[3, vocab])
        with pytest.raises(ValueError, match=f"stop_token_ids: token id {vocab} is outside"):
            llm.generate([[5, 6]], bad_stop, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        top = llm.generate([[5, 6, 7]], GREEDY.replace(logprobs=20, prompt_logprobs=20))[0]
        assert len(top.outputs[0].logprobs[0]) in (20, 21)  # the chosen token may be extra
    for seed in (2**64, -(2**63) - 1, 2**70):
        with pytest.raises(ValueError, match=f"seed must be .*64-bit.*got {seed}"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} must be None or an integer from 0 to 20"):
            SamplingParams(**{name: 21})
