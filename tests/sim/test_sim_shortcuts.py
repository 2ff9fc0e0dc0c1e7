"""Issue 20's simulator shortcuts in the scheduler change no decision.

* ``Scheduler.schedule_plain`` forms the batch ``schedule`` forms (same id,
  prediction, decodes, chunks, preemptions) and leaves the same state;
* the prefill queue's count of prompts shorter than the long threshold
  follows pushes, removals and a preemption's longer prompt, and the scan
  that stops on it takes the chunks the full scan takes;
* ``DecodeLanes.one_group_times`` prices each step as ``totals`` does.
"""

from __future__ import annotations

import random

import pytest

from medha_sched.decode_set import ZERO_TOKENS
from medha_sched.output import BatchResult
from medha_sched.policies import get_policy
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler, _PrefillQueue
from medha_sched.sim.runner import RunSpec

RESULT = BatchResult(sampled_token_ids=ZERO_TOKENS)


def requests(seed: int, n: int, long_every: int, out_max: int) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        prompt = (
            rng.randint(40_000, 90_000)
            if long_every and i % long_every == 0
            else rng.randint(20, 3000)
        )
        out.append((t, prompt, rng.randint(1, out_max)))
    return out


def shape(out) -> tuple:
    chunks = [(c.request_id, c.num_tokens, c.samples) for c in out.prefill_chunks]
    return out.batch_id, out.predicted_time, out.decodes.count, chunks, len(out.preempted)


@pytest.mark.parametrize(
    ("policy", "kv_tokens", "kvp"),
    [
        ("lars-mp", 2_000_000, 1),
        ("lars", 150_000, 1),
        ("lars-mp", 400_000, 2),
        ("fcfs", 120_000, 1),
        ("lars-mp", 12_000, 1),
        ("fcfs", 16_000, 2),
    ],
)
def test_plain_schedule_forms_the_same_batches(policy: str, kv_tokens: int, kvp: int) -> None:
    spec = RunSpec(
        policy=policy,
        tp=8,
        spp=2,
        kvp=kvp,
        kv_cache_tokens=kv_tokens,
        max_tokens_per_group=min(65_536, kv_tokens // 2) if kvp > 1 else None,
        long_threshold=32_768,
    )
    config, model, cache = spec.build()
    full, plain = Scheduler(config, model, cache=cache), Scheduler(config, model, cache=cache)
    tight = kv_tokens < 100_000  # tight memory: short prompts, long outputs, preemptions
    arrivals = requests(1, 40, long_every=0 if tight else 3, out_max=600 if tight else 60)
    flying: list[int] = []
    now, i, batches, chunks = 0.0, 0, 0, 0
    while i < len(arrivals) or full.has_unfinished_requests():
        while i < len(arrivals) and arrivals[i][0] <= now:
            for s in (full, plain):
                s.add_request(Request(f"r{i}", arrivals[i][0], arrivals[i][1], arrivals[i][2]))
            i += 1
        want = shape(full.schedule(now))
        got = plain.schedule_plain(now)
        assert got == want
        if want[2] or want[3]:
            batches += 1
            chunks += len(want[3])
            flying.append(want[0])
            for s in (full, plain):
                s.on_stage_end(want[0])
        if len(flying) > 1 or (flying and not (want[2] or want[3])):
            b = flying.pop(0)
            assert full.on_batch_end(b, RESULT) == plain.on_batch_end(b, RESULT)
        assert full.num_preemptions == plain.num_preemptions
        assert full.num_queued == plain.num_queued and full.num_running == plain.num_running
        now += 0.01
    assert not plain.has_unfinished_requests()
    assert batches > 100 and chunks > 30
    assert full.num_preemptions > 0 or not tight


def test_queue_counts_prompts_below_the_long_threshold() -> None:
    q = _PrefillQueue(get_policy("lars-mp"), short_below=32, long_min=1000)
    a, b, c = Request("a", 0.0, 999, 5), Request("b", 0.0, 1000, 5), Request("c", 0.1, 10, 5)
    for r in (a, b, c):
        r.deadline, r.total_work, r.remaining_work = 1.0, 0.5, 0.5
        q.push(r)
    assert q.num_not_long == 2
    q.push(a)  # a refresh counts once
    assert q.num_not_long == 2
    a.num_prefill_tokens = 1500  # preempted by recompute: its prompt grew past the threshold
    q.push(a)
    assert q.num_not_long == 1
    q.remove("c")
    q.remove("c")  # absent: nothing changes
    assert q.num_not_long == 0 and len(q) == 2


def test_one_group_times_price_each_step_like_totals() -> None:
    config, model, cache = RunSpec(policy="lars-mp", tp=8, spp=1).build()
    s = Scheduler(config, model, cache=cache)
    for i in range(7):
        s.add_request(Request(f"r{i}", 0.0, 100 + 333 * i, 500))
    now = 0.0
    while s.num_queued:
        out = s.schedule(now)
        s.on_batch_end(out.batch_id, RESULT)
        now += 0.05
    lanes = s._lanes
    lane = lanes.gather()
    assert lane is not None and len(lane.members) == 7
    times = lanes.one_group_times(lane, model.group_time, 300)
    assert times == [model.group_time(lanes.totals(lane, j)[0]) for j in range(300)]
    budget = sum(times[:40]) - 1e-9
    assert lanes.one_group_times(lane, model.group_time, 300, budget) == times[:40]
