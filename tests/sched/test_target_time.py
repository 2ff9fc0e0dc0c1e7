"""``Scheduler.set_target_batch_time``: a new budget T changes the next batches."""

from __future__ import annotations

import pytest

from medha_sched import (
    AffineCostModel,
    BatchResult,
    Request,
    Scheduler,
    SchedulerConfig,
)
from medha_sched.cost.online import OnlineCostModel

# 1 ms a step plus 0.1 ms a token: a chunk of n tokens alone takes 1 + 0.1 n ms
MODEL = AffineCostModel(base=1e-3, per_token=1e-4, per_attn=0.0)


def first_chunk(sched: Scheduler, now: float) -> tuple[int, float]:
    out = sched.schedule(now)
    (chunk,) = out.prefill_chunks
    sched.on_batch_end(out.batch_id, BatchResult({}))
    return chunk.num_tokens, out.target_time


def test_a_new_budget_sizes_the_next_chunks() -> None:
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), MODEL)
    sched.add_request(Request("a", 0.0, 20_000, 1))
    # the largest 32-token multiple with 1 + 0.1 n <= 50 ms
    assert first_chunk(sched, 0.0) == (480, 0.05)
    before = sched.get_request("a").remaining_work
    sched.set_target_batch_time(0.2)
    assert sched.config.target_batch_time == 0.2
    # 1 + 0.1 n <= 200 ms: 1,984 tokens, packed against the new T
    assert first_chunk(sched, 1.0) == (1984, 0.2)
    # the queued remainder was re-priced with the new table: fewer chunks, fewer step costs
    after = sched.get_request("a").remaining_work
    assert after < before
    sched.set_target_batch_time(0.02)
    assert first_chunk(sched, 2.0) == (160, 0.02)


def test_the_remaining_work_matches_a_scheduler_built_with_that_budget() -> None:
    moved = Scheduler(SchedulerConfig(target_batch_time=0.05), MODEL)
    moved.set_target_batch_time(0.3)
    fresh = Scheduler(SchedulerConfig(target_batch_time=0.3), MODEL)
    for sched in (moved, fresh):
        sched.add_request(Request("a", 0.0, 9_000, 1))
    a, b = moved.get_request("a"), fresh.get_request("a")
    assert a.remaining_work == pytest.approx(b.remaining_work, rel=1e-12)
    assert a.deadline == pytest.approx(b.deadline, rel=1e-12)


def test_a_learning_model_keeps_the_start_up_feasibility() -> None:
    # grid chunks cost 40 ms at the start: feasible under T = 50 ms only
    online = OnlineCostModel((0.039, 0.0, 0.0, 0.0, 0.0))
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), online)
    longest = sched.max_prompt_tokens
    sched.set_target_batch_time(0.03)  # every grid chunk is priced above this T now
    assert sched.max_prompt_tokens == longest
    sched.add_request(Request("a", 0.0, 1_000, 1))  # admitted, not refused
    fixed = Scheduler(SchedulerConfig(target_batch_time=0.05), MODEL)
    fixed.set_target_batch_time(0.0005)  # a fixed model: its feasibility follows T
    assert fixed.max_prompt_tokens < longest


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "0.1", True])
def test_a_bad_budget_is_refused_and_changes_nothing(bad) -> None:
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), MODEL)
    table = sched.prefill_times
    with pytest.raises(ValueError, match=f"target_batch_time must be .*got {bad!r}"):
        sched.set_target_batch_time(bad)
    assert sched.config.target_batch_time == 0.05 and sched.prefill_times is table
