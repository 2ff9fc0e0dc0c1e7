"""Hypothesis strategies: random workloads and scheduler set-ups."""

from __future__ import annotations

from hypothesis import strategies as st

from medha_sched.config import CacheConfig, ParallelDegrees, SchedulerConfig
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler

from .models import poly_models

POLICIES = ["fcfs", "edf", "lrs", "lars", "lars-mp", "srpt"]


@st.composite
def setups(
    draw,
    *,
    adaptive: bool | None = None,
    tight_memory: bool | None = None,
    prefix_caching: bool = False,
):
    layout = ParallelDegrees(spp=draw(st.integers(1, 3)), kvp=draw(st.integers(1, 3)))
    model = draw(poly_models(layout))
    block = draw(st.sampled_from([4, 16]))
    tight = draw(st.booleans()) if tight_memory is None else tight_memory
    blocks = draw(st.integers(40, 80) if tight else st.integers(400, 800))
    gmax = block * draw(st.integers(max(8, blocks // 3), blocks))
    cache = CacheConfig(
        block_size=block,
        num_blocks_per_group=blocks,
        max_tokens_per_group=gmax,
        watermark=0.01 if tight else 0.05,
        enable_prefix_caching=prefix_caching,
    )
    is_adaptive = draw(st.booleans()) if adaptive is None else adaptive
    chunk = None if is_adaptive else draw(st.sampled_from([0, 64, 256]))
    config = SchedulerConfig(
        policy=draw(st.sampled_from(POLICIES)),
        target_batch_time=draw(st.floats(0.01, 0.2)),
        chunk_size=chunk,
        token_grid=draw(st.sampled_from([1, 8, 32])),
        max_chunk_tokens=draw(st.sampled_from([64, 256, 2048])),
        max_batch_requests=draw(st.integers(2, 64)),
        long_prefill_threshold=draw(st.sampled_from([128, 1024])),
        min_deadline=draw(st.floats(0.01, 2.0)),
        cache_aware_slack=draw(st.booleans()) if prefix_caching else True,
    )
    return Scheduler(config, model, cache=cache)


@st.composite
def workloads(draw, sched: Scheduler, *, heavy: bool = False, shared_prefixes: bool = False):
    """Random requests; with ``shared_prefixes`` many start with a prefix of
    one of two shared token streams (``prefix_id``, ``prefix_tokens``)."""
    n = draw(st.integers(1, 10))
    cap = max(1, min(sched.max_prompt_tokens, 4000))
    spread = 0.01 if heavy else draw(st.sampled_from([0.01, 1.0]))
    out = []
    for i in range(n):
        if heavy:
            prompt = draw(st.integers(max(1, cap // 4), max(1, cap // 2)))
        else:
            prompt = draw(st.one_of(st.integers(1, min(cap, 300)), st.integers(1, cap)))
        output = draw(st.integers(16, 64) if heavy else st.integers(1, 64))
        ttft = draw(st.one_of(st.none(), st.floats(0.05, 5.0)))
        prefix_id, prefix_tokens = None, 0
        if shared_prefixes and draw(st.integers(0, 3)):
            prefix_id = draw(st.sampled_from(["doc-a", "doc-b"]))
            prefix_tokens = draw(st.integers(0, prompt))
        if prompt > sched.max_prompt_tokens or prompt + output > sched.max_context_tokens:
            continue
        out.append(
            Request(
                f"r{i}",
                draw(st.floats(0.0, spread)),
                prompt,
                output,
                ttft_slo=ttft,
                priority=draw(st.sampled_from([0, 0, 0, 1])),
                prefix_id=prefix_id,
                prefix_tokens=prefix_tokens,
            )
        )
    return out
