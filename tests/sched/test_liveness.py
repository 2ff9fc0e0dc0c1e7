"""Liveness: a batch that would otherwise be empty does not stop looking after
``max_consecutive_skips`` candidates while a queued request could run.

Under overload the candidates first in policy order are often waiting
requests with no KV memory for their prompts yet; an admitted request in the
middle of its prefill holds its memory and can always take its next chunk. A
server found the scan giving up before reaching it, formed no batch for 101
steps and stopped (``budget.py --runs admission`` at twice capacity).
"""

from __future__ import annotations

from medha_sched import (
    BatchResult,
    CacheConfig,
    Request,
    Scheduler,
    SchedulerConfig,
    parse_cost_model_spec,
)


def _scheduler(skips: int) -> Scheduler:
    model = parse_cost_model_spec("affine:base=0.001,per_token=1e-4,per_attn=0")
    cache = CacheConfig(block_size=16, num_blocks_per_group=100)  # 1,600 tokens of KV
    config = SchedulerConfig(policy="fcfs", target_batch_time=0.02, max_consecutive_skips=skips)
    return Scheduler(config, model, cache=cache)


def test_an_empty_batch_looks_past_the_skip_limit() -> None:
    sched = _scheduler(skips=4)
    sched.add_request(Request("big", 0.0, 1200, 1))  # 75 of the 100 blocks
    out = sched.schedule(0.0)
    assert [c.request_id for c in out.chunks] == ["big"]
    assert out.chunks[0].num_tokens < 1200  # a first chunk: the prefill goes on
    sched.on_stage_end(out.batch_id)  # "big" is back in the queue with its next chunk
    for i in range(10):  # served first (a stricter class), none fits in 25 blocks
        sched.add_request(Request(f"w{i}", 0.001, 800, 1, priority=-1))
    out2 = sched.schedule(0.002)
    assert [c.request_id for c in out2.chunks] == ["big"]
    assert out2.chunks[0].start == out.chunks[0].num_tokens


def test_a_batch_with_work_still_stops_at_the_skip_limit() -> None:
    """Once the batch holds a chunk, the limit bounds the scan as before."""
    sched = _scheduler(skips=2)
    sched.add_request(Request("big", 0.0, 1200, 1))
    first = sched.schedule(0.0)
    sched.on_stage_end(first.batch_id)
    sched.add_request(Request("small", 0.0005, 16, 1, priority=-2))  # first, and fits
    for i in range(10):
        sched.add_request(Request(f"w{i}", 0.001, 800, 1, priority=-1))
    out = sched.schedule(0.002)
    assert [c.request_id for c in out.chunks] == ["small"]  # two skips, then the scan stops


def test_an_empty_batch_takes_one_grid_chunk_when_the_model_prices_every_chunk_over_t() -> None:
    """A learning model that met a slow device can price every chunk over T; with
    nothing in flight the scheduler still issues one grid chunk (over budget)
    instead of an empty batch, and keeps within T once the model is sane again."""
    from medha_sched.cost.online import OnlineCostModel

    model = OnlineCostModel((0.001, 0.0, 1e-4, 0.0, 0.0))
    cache = CacheConfig(block_size=16, num_blocks_per_group=1000)
    config = SchedulerConfig(policy="lars-mp", target_batch_time=0.02, token_grid=32)
    sched = Scheduler(config, model, cache=cache)
    sched.add_request(Request("a", 0.0, 1000, 1))
    out = sched.schedule(0.0)
    assert [c.request_id for c in out.chunks] == ["a"] and out.chunks[0].num_tokens == 160
    sched.on_stage_end(out.batch_id)
    sched.on_batch_end(out.batch_id, BatchResult({}, frozenset()))
    model.rescale(1000.0)  # a 32-token chunk now costs 4.2 s against T = 20 ms
    stuck = sched.schedule(0.1)
    assert [(c.request_id, c.start, c.num_tokens) for c in stuck.chunks] == [("a", 160, 32)]
    sched.on_stage_end(stuck.batch_id)
    sched.on_batch_end(stuck.batch_id, BatchResult({}, frozenset()))
    model.rescale(1e-3)  # back to the first prices: a full-budget chunk again
    again = sched.schedule(0.2)
    assert [(c.request_id, c.start, c.num_tokens) for c in again.chunks] == [("a", 192, 160)]
