"""A joined scan's second visit, told without the walk.

``turn_run``'s scan turns call ``_pack_prefills(..., joined=r)`` with the
queue's first prompt's chunk already in the draft. Where that prompt is long
(every other long prompt blocked) and a short prompt is queued,
``Scheduler._second_visit`` makes the second candidate's visit without
walking to it: the budget check ends the scan, or the places of the short
prompts (``ScanCursor.longs_ahead``) pass over the long prompts before the
first of them, or the walk visits it as before. These tests run every joined
scan twice, on a deep copy with the second candidate walked to (the plain
path), and compare what the two leave; and whole simulations with and
without the shortcut (every record, batch and float the same), with each of
its three outcomes taken.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from medha_sched.scheduler import Scheduler
from medha_sched.sim.engine import Simulator
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sched.test_scan_pass_over import _scan_state
from tests.sim.same import MIXED_CASES, assert_same_results, mixed_long_short_trace
from tests.sim.same import simulate_with_skips as _run

_SECOND = Scheduler._second_visit
_SCAN = Scheduler._pack_prefills


def _walks(self, draft, walk, now, spent, max_skips):
    return None, 0  # the walk visits the second candidate (the plain path)


def _outcomes(monkeypatch) -> dict[str, int]:
    """The second visits by outcome: the scan ended, long prompts passed over
    (or none: the short prompt second), the walk visiting it."""
    counts = {"ended": 0, "passed": 0, "walked": 0}

    def counted(self, draft, walk, now, spent, max_skips):
        cursor, skips = _SECOND(self, draft, walk, now, spent, max_skips)
        if skips < 0:
            counts["ended"] += 1
        elif cursor is not None and cursor.passed:
            counts["passed"] += 1
        else:
            counts["walked"] += 1
        return cursor, skips

    monkeypatch.setattr(Scheduler, "_second_visit", counted)
    return counts


def _roofline_trace(seed: int):
    return generate(WorkloadSpec(qps=2.0, num_requests=120, long_fraction=0.3, seed=seed))


_ROOFLINE = RunSpec(
    policy="lars-mp",
    cost_model="roofline:model=llama3-8b,gpu=a100",
    tp=8,
    spp=2,
    target_batch_time=0.05,
)


# the first scans of each run are twinned (a deep copy each: the later ones,
# with more state, cost the most); the counts below cover the whole run
_TWINNED = 250


@pytest.mark.parametrize("seed", [2, 5])
def test_each_joined_scan_leaves_what_the_walk_leaves(monkeypatch, seed: int) -> None:
    """Every joined scan is also run on a deep copy of the scheduler and its
    draft with the second candidate walked to: the same ids and the same
    state after it. ``_walked`` may differ only where both hold fewer ids than
    the skip limit (``_shorts_out_of_reach`` then answers False for either)."""
    counts = _outcomes(monkeypatch)
    counted = Scheduler._second_visit
    twins = {"scans": 0, "walked_differs": 0}

    def twin(self, draft, now, *, take=True, joined=None):
        if joined is None or twins["scans"] >= _TWINNED:
            return _SCAN(self, draft, now, take=take, joined=joined)
        other, other_draft = copy.deepcopy((self, draft))
        monkeypatch.setattr(Scheduler, "_second_visit", _walks)
        want = _SCAN(other, other_draft, now, take=take, joined=other._requests[joined.request_id])
        monkeypatch.setattr(Scheduler, "_second_visit", counted)
        got = _SCAN(self, draft, now, take=take, joined=joined)
        assert got == want
        assert _scan_state(self, draft) == _scan_state(other, other_draft)
        if self._walked != other._walked:
            twins["walked_differs"] += 1
            limit = self.config.max_consecutive_skips
            assert len(self._walked) < limit and len(other._walked) < limit
        twins["scans"] += 1
        return got

    monkeypatch.setattr(Scheduler, "_pack_prefills", twin)
    config, model, cache = _ROOFLINE.build()
    Simulator(config, model, cache=cache).run(_roofline_trace(seed))
    assert twins["scans"] > 100, twins
    assert counts["ended"] > 10 and counts["passed"] > 50 and counts["walked"] > 0, counts
    assert twins["walked_differs"] > 0, twins  # the scans that ended left [] for [first, second]


@pytest.mark.parametrize(("policy", "skips", "spp", "seed"), MIXED_CASES)
def test_mixed_simulations_match_the_walk(monkeypatch, policy, skips, spp, seed) -> None:
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = mixed_long_short_trace(seed, longs=3 * skips + 6, shorts=90)
    counts = _outcomes(monkeypatch)
    fast = _run(trace, spec, skips)
    assert all(r.finish_s is not None for r in fast.records)
    assert counts["passed"] > 5, counts
    monkeypatch.setattr(Scheduler, "_second_visit", _walks)
    assert_same_results(fast, _run(trace, spec, skips))


@pytest.mark.parametrize(("spp", "skips"), [(2, 16), (4, 16), (2, 3), (2, 2)])
def test_roofline_simulations_match_the_walk(monkeypatch, spp: int, skips: int) -> None:
    spec = dataclasses.replace(_ROOFLINE, spp=spp)
    trace = _roofline_trace(spp)
    counts = _outcomes(monkeypatch)
    fast = _run(trace, spec, skips)
    if skips >= 3:
        assert counts["ended"] > 10 and counts["passed"] > 50, counts
    else:  # with two skips or fewer, _walked's two ids may matter: always walked
        assert counts["ended"] == counts["passed"] == 0 and counts["walked"] > 50, counts
    monkeypatch.setattr(Scheduler, "_second_visit", _walks)
    assert_same_results(fast, _run(trace, spec, skips))
