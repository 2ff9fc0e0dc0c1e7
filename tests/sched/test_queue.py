"""The prefill queue's count of requests with few prompt tokens left, and the
scan that relies on it (it stops once no queued request can be chosen)."""

from __future__ import annotations

from medha_sched import CacheConfig, Request, Scheduler, SchedulerConfig, parse_cost_model_spec
from medha_sched.policies import get_policy
from medha_sched.queue import PrefillQueue


def test_counts_requests_with_few_tokens_left_as_of_their_last_push() -> None:
    queue = PrefillQueue(get_policy("fcfs"), short_below=32)
    queue.push(Request("long", 0.0, 500, 1))
    assert not queue.has_remaining_below(32)
    short = Request("short", 0.0, 40, 1)
    queue.push(short)
    assert not queue.has_remaining_below(32)  # 40 tokens left
    short.num_scheduled_tokens = 32
    queue.push(short)  # progress: 8 left
    assert queue.has_remaining_below(32)
    assert queue.has_remaining_below(9)
    assert not queue.has_remaining_below(8)
    queue.remove("short")
    assert not queue.has_remaining_below(32)
    assert len(queue) == 1


def test_a_full_batch_stops_the_scan_at_once() -> None:
    """Decodes leave less room than one grid chunk: the scan examines the first
    candidate only, not max_consecutive_skips of them, and takes none."""
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100")
    cache = CacheConfig(block_size=16, num_blocks_per_group=1 << 16)
    sched = Scheduler(SchedulerConfig(policy="lars", target_batch_time=0.02), model, cache=cache)
    sched.add_request(Request("first", 0.0, 8000, 8))
    out = sched.schedule(0.0)
    assert [c.request_id for c in out.chunks] == ["first"]  # one chunk fills the budget
    for i in range(100):
        sched.add_request(Request(f"w{i}", 0.0, 1000, 1))
    sched.on_stage_end(out.batch_id)  # "first" is back in the queue with its next chunk
    index = next(iter(sched._queue._classes.values()))
    examined = 0
    original = index._best_first

    def counting():
        nonlocal examined
        for item in original():
            examined += 1
            yield item

    index._best_first = counting
    out2 = sched.schedule(0.001)  # the previous batch is still in flight
    assert [c.request_id for c in out2.chunks] == ["first"]
    assert examined <= 2, f"the scan examined {examined} candidates"
