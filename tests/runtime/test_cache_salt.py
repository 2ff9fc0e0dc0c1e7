"""``cache_salt`` offline: a prompt dict's salt keeps its prefix-cache hits to
prompts of the same salt (vLLM's ``{"prompt_token_ids": [...], "cache_salt": ...}``)."""

from __future__ import annotations

import random

import pytest

from medha_runtime import LLM, SamplingParams
from medha_sched import AffineCostModel

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
COMMON = {"cost_model": COST, "policy": "fcfs", "block_size": 4, "max_model_len": 80}

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOC = [random.Random(2).randrange(3, 200) for _ in range(40)]


def _prompt(salt: str | None, tail: int) -> dict:
    p: dict = {"prompt_token_ids": [*DOC, tail]}
    if salt is not None:
        p["cache_salt"] = salt
    return p


def _cached(llm: LLM, salt: str | None, tail: int) -> tuple[int, list[int]]:
    out = llm.generate(_prompt(salt, tail), PARAMS, use_tqdm=False)[0]
    return out.num_cached_tokens, list(out.outputs[0].token_ids)


def test_a_salted_prompt_hits_only_blocks_of_its_own_salt() -> None:
    with LLM("tiny", **COMMON) as llm:
        runs = [
            ("a", 5, 0),
            ("b", 6, 0),  # another salt: nothing shared
            (None, 7, 0),  # no salt: the salted blocks are not its
            ("a", 8, 40),
            ("b", 9, 40),
            (None, 10, 40),  # unsalted prompts share among themselves
        ]
        for salt, tail, want in runs:
            assert _cached(llm, salt, tail)[0] == want, (salt, tail)
        # the KV reused is the prompt's own: the same greedy tokens as a cold run
        assert _cached(llm, "a", 11)[1] == _cached(llm, "fresh", 11)[1]


def test_without_prefix_caching_a_salt_is_accepted_and_changes_nothing() -> None:
    with LLM("tiny", enable_prefix_caching=False, **COMMON) as llm:
        assert _cached(llm, "a", 5)[0] == 0
        assert _cached(llm, "a", 6)[0] == 0


def test_an_empty_or_non_string_salt_is_refused() -> None:
    with LLM("tiny", **COMMON) as llm:
        for salt in ("", 7, b"x"):
            with pytest.raises(ValueError, match="prompt 0: cache_salt must be a non-empty str"):
                llm.generate({"prompt": "hi", "cache_salt": salt}, PARAMS, use_tqdm=False)
        # null is no salt, as on the server
        assert llm.generate({"prompt": "hi", "cache_salt": None}, PARAMS, use_tqdm=False)
