"""The scan's stop once the floor passes over every queued request leaves out
the candidates it has already visited.

A prompt chunked to fewer than ``token_grid`` tokens left is listed among the
short ones until the take that follows the scan choosing it: before, a scan
that chose it first and then filled the budget (floor set at one grid chunk)
found it still listed and walked on to ``max_consecutive_skips`` candidates,
none of which could join. The walk meets no candidate twice, so the visited
ones do not count; and the stop is checked again after a candidate is
examined under the floor (a tail chosen after the floor was first set, the
floor then set again at the same value). These tests check the queue's count with ``met``, that such
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


def _bench(impl: str, target: float, waiting: int, seed: int) -> Scheduler | ReferenceScheduler:
    """``benchmarks/scheduler.py``'s setting, small: 32 decodes (prefilled
    alongside), ``waiting`` short prompts arriving at once, T = ``target``."""
    rng = random.Random(seed)
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100")
    cache = CacheConfig(block_size=16, num_blocks_per_group=1 << 18)
    config = SchedulerConfig(policy="lars", target_batch_time=target)
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


def test_a_scan_that_chose_the_short_tails_stops_at_once() -> None:
    """Every scan that chose every prompt listed as short (tails of fewer than
    ``token_grid`` tokens) stops within a few candidates of its last chunk;
    the batches are the reference's. The settings: the benchmark's budget
    and a tighter one (fewer chunks per batch, the tails met later)."""
    stops = 0
    for target, seed in [(0.05, 0), (0.05, 1), (0.02, 2), (0.02, 4), (0.03, 0), (0.03, 7)]:
        stops += _short_tail_scans(target, seed)
    assert stops >= 20, f"{stops} scans chose the short tails"


def _short_tail_scans(target: float, seed: int) -> int:
    new, ref = _bench("new", target, 300, seed), _bench("reference", target, 300, seed)
    index = None
    walked: list[str] = []
    now = 0.0
    stops = 0
    for _ in range(200):
        queue = new._queue
        if index is None and queue._classes:
            index = next(iter(queue._classes.values()))
            original = index._best_first

            def recording(original=original):
                for item in original():
                    walked.append(item)
                    yield item

            index._best_first = recording
        walked.clear()
        short_first = set(queue._short)  # (the previous take is flushed by the scan)
        out, later = _step(new, now)
        out_ref, _ = _step(ref, now)
        assert (out.chunks, out.predicted_time) == (out_ref.chunks, out_ref.predicted_time)
        chosen = [c.request_id for c in out.chunks if c.num_tokens > 1 or not c.samples]
        if short_first and short_first <= set(chosen) and set(chosen) <= set(walked):
            stops += 1
            last = max(walked.index(rid) for rid in chosen)
            # the candidate that sets the floor, then the stop (16 more before)
            assert len(walked) - last - 1 <= 3, f"the scan walked {walked} for {chosen}"
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
