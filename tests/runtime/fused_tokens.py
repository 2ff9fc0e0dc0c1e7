"""Greedy tokens of the tiny model with one of ``llama``'s fused native calls replaced:
the shared half of the fused-call tests (a fused call leaves the tokens as the separate
calls give them, in one process and across kvp=2's ranks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import medha_runtime.model.llama as llama
from medha_runtime import LLM, SamplingParams
from medha_sched import AffineCostModel

PROMPTS = ["Medha shards the KV cache of long prompts", "Hi", "The sky over the port was"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
COMMON = {
    "cost_model": AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9),
    "policy": "fcfs",
    "chunk_size": 16,
    "kv_cache_tokens": 1024,
    "device": "cpu",
}


def greedy_tokens(kvp: int = 1, replace: tuple[str, Callable] | None = None) -> list[list[int]]:
    """Each prompt's greedy tokens from an ``LLM("tiny")`` with ``kvp`` KVP groups
    (kvp=2: 32-token groups, and at least one chunk sharded), with ``llama``'s attribute
    ``replace[0]`` set to ``replace[1]`` while it runs (in this process only: kvp=2's
    ranks run the code as it is)."""
    mp = pytest.MonkeyPatch()
    if replace is not None:
        mp.setattr(llama, *replace)
    kw = {"kvp": 2, "kvp_group_tokens": 32} if kvp == 2 else {}
    try:
        with LLM("tiny", max_model_len=64, **COMMON, **kw) as llm:
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
            if kvp == 2:
                assert llm.engine.stats.sharded_chunks > 0
            return tokens
    finally:
        mp.undo()
