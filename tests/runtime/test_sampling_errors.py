"""A request whose token cannot be sampled (non-finite logits) ends with
``finish_reason="error"``; the others in its batch get their own tokens and the
engine goes on serving, in one process and with worker processes (spp = 2, tp = 2;
with async scheduling a later batch already holds the failed request's next decode)."""

from __future__ import annotations

import pytest

from medha_runtime import LLM, SamplingParams
from medha_sched import AffineCostModel
from tests.runtime.poisoned import POISON, save_poisoned

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
CLEAN = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]
#: fails at its first token: the prompt holds the poisoned token
IN_PROMPT = [72, 105, POISON, 32, 116, 104, 101, 114, 101]
SEEDED = SamplingParams(temperature=0.9, seed=123, max_tokens=8, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
DRAWN = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
#: greedy with logprobs: the sampler's general path, not the plain arg-max
GREEDY_LP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
#: draws the poisoned token first, so its next token (a decode) fails
DRAWS_POISON = SamplingParams(
    temperature=1.0, max_tokens=8, ignore_eos=True, logit_bias={POISON: 100.0}
)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_poisoned(tmp_path_factory.mktemp("poisoned")))


LAYOUTS = {
    "one-process": {},
    "async": {"async_scheduling": True},
    "spp2-workers": {"spp": 2, "async_scheduling": False},
    "spp2-async-workers": {"spp": 2, "async_scheduling": True},
    "tp2-workers": {"tp": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_request_that_cannot_be_sampled_ends_alone_with_an_error(poisoned, layout) -> None:
    kw = LAYOUTS[layout]
    with LLM(poisoned, max_model_len=256, cost_model=COST, seed=0, **kw) as llm:
        solo = [o.outputs[0] for o in llm.generate([CLEAN, CLEAN], [SEEDED, GREEDY])]
        assert all(o.finish_reason == "length" for o in solo)
        outs = llm.generate([IN_PROMPT, CLEAN, CLEAN, CLEAN], [DRAWN, SEEDED, DRAWS_POISON, GREEDY])
        bad_prompt, seeded, bad_decode, greedy = (o.outputs[0] for o in outs)
        for bad in (bad_prompt, bad_decode):
            assert bad.finish_reason == "error" and bad.stop_reason is None
            assert "probability tensor contains either" in bad.error
        assert bad_prompt.token_ids == [] and bad_decode.token_ids == [POISON]
        assert seeded.token_ids == solo[0].token_ids and seeded.error is None
        assert greedy.token_ids == solo[1].token_ids
        assert llm.engine.dead is None and not llm.engine.has_unfinished_requests()
        again = [o.outputs[0] for o in llm.generate([CLEAN, CLEAN], [SEEDED, GREEDY])]
        assert [o.token_ids for o in again] == [o.token_ids for o in solo]
        # greedy: the arg-max of NaN logits raised nothing and gave token 0 ("\x00")
        for params in (GREEDY, GREEDY_LP):
            outs = llm.generate([IN_PROMPT, CLEAN], [params, GREEDY])
            bad, clean = (o.outputs[0] for o in outs)
            assert bad.finish_reason == "error" and bad.token_ids == [], bad
            assert "the largest logit is not finite" in bad.error
            assert clean.token_ids == solo[1].token_ids
