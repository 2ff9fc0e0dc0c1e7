"""``Scheduler._shorts_out_of_reach`` does not read the keys when fewer than
``max_consecutive_skips`` ids were walked: the proof counts distinct ids among
the first prompt's and the walk's, so it cannot find more than the skip limit.

Whole simulations with the shortcut against the same simulations with the
form it had before (the keys read whenever the other conditions hold): every
record, batch and float the same, each answer the old form's (asked too,
at every call), and the shortcut taken many times.
"""

from __future__ import annotations

import dataclasses

import pytest

from medha_sched.request import Request
from medha_sched.scheduler import Scheduler
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sim.same import MIXED_CASES, assert_same_results, paper_spec
from tests.sim.same import mixed_long_short_trace as _mixed_trace
from tests.sim.same import simulate_with_skips as _run


def _old_reach(self: Scheduler, first: Request, now: float) -> bool:
    """The proof as it was written before the shortcut."""
    cfg = self.config
    queue, walked = self._queue, self._walked
    max_skips = cfg.max_consecutive_skips
    return (
        bool(walked)
        and first.num_prefill_tokens >= cfg.long_prefill_threshold
        and queue.num_not_long <= 4 * max_skips
        and queue.ahead_of_not_long([first.request_id, *walked], now) > max_skips
    )


def _checked(monkeypatch) -> dict[str, int]:
    """Patch in the shortcut, asking the old form too where it is taken."""
    counts = {"calls": 0, "short_cut": 0}
    new = Scheduler._shorts_out_of_reach

    def checked(self, first, now):
        got = new(self, first, now)
        counts["calls"] += 1
        assert got == _old_reach(self, first, now)
        if len(self._walked) < self.config.max_consecutive_skips:
            counts["short_cut"] += (
                bool(self._walked)
                and first.num_prefill_tokens >= self.config.long_prefill_threshold
                and self._queue.num_not_long <= 4 * self.config.max_consecutive_skips
            )
        return got

    monkeypatch.setattr(Scheduler, "_shorts_out_of_reach", checked)
    return counts


@pytest.mark.parametrize(("policy", "skips", "spp", "seed"), MIXED_CASES[:3])
def test_mixed_simulations_match_the_old_proof(monkeypatch, policy, skips, spp, seed) -> None:
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = _mixed_trace(seed, longs=3 * skips + 6, shorts=90)
    counts = _checked(monkeypatch)
    fast = _run(trace, spec, skips)
    assert counts["calls"] > 20
    monkeypatch.setattr(Scheduler, "_shorts_out_of_reach", _old_reach)
    assert_same_results(fast, _run(trace, spec, skips))


def test_an_overloaded_roofline_run_matches_the_old_proof(monkeypatch) -> None:
    trace = generate(WorkloadSpec(qps=2.0, num_requests=200, long_fraction=0.3, seed=2))
    spec = paper_spec()
    # turn_run's scans walk their second candidate, as they did when this was
    # written: a scan that ends there leaves [] (see Scheduler._second_visit),
    # where the walk leaves the two ids this shortcut turns away
    monkeypatch.setattr(Scheduler, "_second_visit", lambda self, *args: (None, 0))
    counts = _checked(monkeypatch)
    fast = _run(trace, spec, 16)
    assert counts["short_cut"] > 20  # the old form read the keys there, for False
    monkeypatch.setattr(Scheduler, "_shorts_out_of_reach", _old_reach)
    assert_same_results(fast, _run(trace, spec, 16))


def test_the_skip_limit_of_ids_walked_is_enough(monkeypatch) -> None:
    # edf, 4 long prompts (earlier deadlines) before a short one, skip limit 3
    spec = RunSpec(policy="edf", tp=8, spp=2, long_threshold=16_384)
    config, model, cache = spec.build()
    config = dataclasses.replace(config, max_consecutive_skips=3)
    s = Scheduler(config, model, cache=cache)
    for i in range(4):
        s.add_request(Request(f"long{i}", 0.001 * i, 20_000, 2, ttft_slo=10.0))
    s.add_request(Request("short", 0.01, 300, 2, ttft_slo=1_000.0))
    first = s._queue.first(0.02)
    assert first is not None and first.request_id == "long0"
    asked = []
    ahead = type(s._queue).ahead_of_not_long

    def spy(self, request_ids, now):
        asked.append(list(request_ids))
        return ahead(self, request_ids, now)

    monkeypatch.setattr(type(s._queue), "ahead_of_not_long", spy)
    s._walked = ["long1", "long2", "long3"]  # 4 distinct ids ahead of the short one
    assert s._shorts_out_of_reach(first, 0.02) is True
    assert _old_reach(s, first, 0.02) is True
    s._walked = ["long0", "long1", "long2", "long3"]  # first among them: 4 again
    assert s._shorts_out_of_reach(first, 0.02) is True
    asked.clear()
    s._walked = ["long1", "long2"]  # 3 ids at most: not more than the limit
    assert s._shorts_out_of_reach(first, 0.02) is False
    assert not asked  # the keys were not read
    assert _old_reach(s, first, 0.02) is False
