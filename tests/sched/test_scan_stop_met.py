"""The scan's stop once the floor passes over every queued request leaves out
the candidates it has already visited.

A prompt chunked to fewer than ``token_grid`` tokens left is listed among the
short ones until the take that follows the scan choosing it: before, a scan
that chose it first and then filled the budget (floor set at one grid chunk)
found it still listed and walked on to ``max_consecutive_skips`` candidates,
none of which could join. The walk meets no candidate twice, so the visited
ones do not count. These tests check the queue's count with ``met``, that such
a scan now stops at once (and forms the reference scheduler's batches), and
whole simulations with the stop against the same ones without it (every
record, batch and float the same, and the new stop taken).
"""

from __future__ import annotations

import random

import pytest

from medha_sched import (
    BatchResult,
    CacheConfig,
    Request,
    Scheduler,
    SchedulerConfig,
    parse_cost_model_spec,
)
from medha_sched.policies import get_policy
from medha_sched.queue import PrefillQueue
from medha_sched.scheduler import _PrefillQueue
from medha_sched.sim import TraceRequest
from tests.sched.reference import ReferenceScheduler
from tests.sim.same import assert_same_results, paper_spec, simulate


def test_met_requests_are_not_counted() -> None:
    queue = PrefillQueue(get_policy("fcfs"), short_below=32)
    for rid, done in (("a", 30), ("b", 20), ("c", 0)):
        r = Request(rid, 0.0, 40, 1)
        r.num_scheduled_tokens = done
        queue.push(r)  # a: 10 left, b: 20 left, c: 40 (not short)
    assert queue.has_remaining_below(32)
    assert queue.has_remaining_below(32, ["a"])  # b still counts
    assert not queue.has_remaining_below(32, ["a", "b"])
    assert not queue.has_remaining_below(15, ["a"])  # b has 20 left: not below 15
    assert queue.has_remaining_below(15, ["b", "c"])
    assert not queue.has_remaining_below(10, [])  # none below 10, met or not


def _bench(impl: str, waiting: int, seed: int) -> Scheduler | ReferenceScheduler:
    """``benchmarks/scheduler.py``'s setting, small: 32 decodes past their
    prefill, then ``waiting`` short prompts arriving at once."""
    rng = random.Random(seed)
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100")
    cache = CacheConfig(block_size=16, num_blocks_per_group=1 << 18)
    config = SchedulerConfig(policy="lars", target_batch_time=0.05)
    cls = Scheduler if impl == "new" else ReferenceScheduler
    sched = cls(config, model, cache=cache)
    for i in range(32):
        sched.add_request(Request(f"d{i}", 0.0, rng.randint(100, 4000), 1 << 20))
    for i in range(waiting):
        sched.add_request(Request(f"w{i}", rng.random(), rng.randint(50, 600), 1))
    return sched


def _step(sched, now: float):
    out = sched.schedule(now)
    sampled = {c.request_id: 1 for c in out.chunks if c.samples}
    sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))
    return out, now + max(out.predicted_time, 1e-3)


def test_a_scan_that_chose_a_short_tail_stops_at_once() -> None:
    """Every scan that chose a prompt listed as short (a tail of fewer than
    ``token_grid`` tokens) stops within a few candidates once the budget is
    spent; the batches are the reference's."""
    stops = sum(_short_tail_scans(seed) for seed in range(4))
    assert stops >= 5, f"{stops} scans chose a short tail"


def _short_tail_scans(seed: int) -> int:
    new, ref = _bench("new", 300, seed), _bench("reference", 300, seed)
    index = None
    examined = 0
    now = 0.0
    stops = 0
    for _ in range(200):
        queue = new._queue
        if index is None and queue._classes:
            index = next(iter(queue._classes.values()))
            original = index._best_first

            def counting(original=original):
                nonlocal examined
                for item in original():
                    examined += 1
                    yield item

            index._best_first = counting
        examined = 0
        short_first = dict(queue._short)  # (the previous take is flushed by the scan)
        out, later = _step(new, now)
        out_ref, _ = _step(ref, now)
        assert (out.chunks, out.predicted_time) == (out_ref.chunks, out_ref.predicted_time)
        prefills = [c for c in out.chunks if c.num_tokens > 1 or not c.samples]
        if any(c.request_id in short_first for c in prefills):
            stops += 1
            # the chosen chunks and the candidate that set the floor, give or
            # take one: not max_consecutive_skips (16) more
            assert examined <= len(prefills) + 3, f"the scan examined {examined}"
        now = later
    return stops


def _trace(seed: int) -> list[TraceRequest]:
    """Short prompts in bursts (many waiting with nearly equal slack), outputs
    of a few tokens, a few long prompts."""
    rng = random.Random(seed)
    out = []
    for i in range(400):
        burst = rng.randrange(4)
        long = rng.random() < 0.03
        out.append(
            TraceRequest(
                f"r{i:03d}",
                burst * 2.0 + rng.random() * 0.05,
                rng.randint(40_000, 70_000) if long else rng.randint(40, 3000),
                rng.randint(1, 12),
            )
        )
    return sorted(out, key=lambda r: (r.arrival_s, r.id))


@pytest.mark.parametrize(("policy", "spp", "seed"), [("lars-mp", 2, 0), ("lars", 1, 1)])
def test_simulations_are_the_same_without_the_stop(
    policy: str, spp: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = _trace(seed)
    spec = paper_spec(policy=policy, spp=spp)
    original = _PrefillQueue.has_remaining_below
    taken = 0

    def counting(self, tokens, met=()):
        nonlocal taken
        answer = original(self, tokens, met)
        taken += answer != original(self, tokens)
        return answer

    monkeypatch.setattr(_PrefillQueue, "has_remaining_below", counting)
    fast = simulate(trace, spec)
    assert taken > 0, "the stop was never taken"
    monkeypatch.setattr(
        _PrefillQueue, "has_remaining_below", lambda self, tokens, met=(): original(self, tokens)
    )
    slow = simulate(trace, spec)
    assert_same_results(fast, slow)
