"""Per-request SLOs and priority reach the scheduler through LLMEngine.add_request."""

from __future__ import annotations

import pytest

from medha_runtime.engine import LLMEngine
from medha_runtime.sampling import SamplingParams


def test_slo_and_priority_reach_the_scheduler() -> None:
    engine = LLMEngine(
        "tiny",
        max_model_len=256,
        kv_cache_tokens=2048,
        cost_model="affine:base=1e-3,per_token=1e-5,per_attn=1e-9",
    )
    try:
        rid = engine.add_request(
            [1, 2, 3], SamplingParams(max_tokens=2), ttft_slo=0.25, tpot_slo=0.5, priority=1
        )
        req = engine.scheduler.get_request(rid)
        assert req.priority == 1 and req.tpot_slo == 0.5
        assert req.deadline == pytest.approx(req.arrival_time + 0.25)
        progress = engine.progress(rid)
        assert progress is not None and progress.deadline == req.deadline
        with pytest.raises(ValueError, match="ttft_slo must be > 0, got -1"):
            engine.add_request([1, 2], SamplingParams(max_tokens=2), ttft_slo=-1)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.progress(rid) is None and engine.kv_cache_usage == 0.0
    finally:
        engine.shutdown()
