"""Batches the scan forms while prompts wait together, taken as prefill turns,
change no result.

``Scheduler.turn_run`` (and ``Scheduler.scan_turn``, the per-turn path) take the
batch ``_pack_prefills`` forms where a short prompt is within its reach (a
long prompt's chunk and a short one's, most often) as a turn: the chosen
prompts stay in the queue's index, renewed in place when the batch clears
stage 0, instead of leaving the queue at the scan and coming back at
``on_stage_end``; a batch with a sampling chunk goes as ``schedule_plain``'s.
These tests check whole simulations with such turns against the same
simulations without them (``Simulator(turn_scans=False)``: ``schedule()``
forms those batches), against the per-turn path (``turn_runs=False``) and
against one batch at a time (``decode_runs=False``): every record, batch and
float the same, and many turns of two chunks or more taken.
"""

from __future__ import annotations

import pytest

from medha_sched.scheduler import Scheduler
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sim.same import (
    MIXED_CASES,
    assert_same_results,
    mixed_long_short_trace,
    simulate_with_skips,
)

_TURN_RUN = Scheduler.turn_run
_SCAN_TURN = Scheduler.scan_turn


def _count_scan_turns(monkeypatch) -> dict[str, int]:
    """Turns of more than one chunk taken in runs, the per-turn path's scan
    turns, and the batches either issued as ``schedule_plain``'s."""
    counts = {"pairs": 0, "run_plain": 0, "scan_turns": 0, "scan_plain": 0}

    def run(self, request, now, horizon, free, ends_before):
        got = _TURN_RUN(self, request, now, horizon, free, ends_before)
        if got is not None:
            counts["pairs"] += sum(1 for k in got.prefills if k > 1)
            counts["run_plain"] += got.plain is not None
        return got

    def scan(self, now):
        got = _SCAN_TURN(self, now)
        counts["scan_turns" if got[-1] else "scan_plain"] += 1
        return got

    monkeypatch.setattr(Scheduler, "turn_run", run)
    monkeypatch.setattr(Scheduler, "scan_turn", scan)
    return counts


@pytest.mark.parametrize(
    ("policy", "skips", "spp", "seed"),
    MIXED_CASES,
)
def test_scan_turns_change_no_result(monkeypatch, policy, skips, spp, seed) -> None:
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = mixed_long_short_trace(seed, longs=3 * skips + 6, shorts=90)
    counts = _count_scan_turns(monkeypatch)
    fast = simulate_with_skips(trace, spec, skips)
    taken = dict(counts)
    assert all(r.finish_s is not None for r in fast.records)
    assert_same_results(fast, simulate_with_skips(trace, spec, skips, turn_scans=False))
    assert_same_results(fast, simulate_with_skips(trace, spec, skips, turn_runs=False))
    assert_same_results(fast, simulate_with_skips(trace, spec, skips, decode_runs=False))
    assert taken["pairs"] > 20, taken  # many scans' batches of two chunks went as turns
    assert taken["run_plain"] + taken["scan_plain"] > 0, taken  # and sampling ones did not


@pytest.mark.parametrize(
    ("spp", "qps", "caching"), [(2, 1.75, True), (4, 2.0, True), (2, 1.75, False)]
)
def test_an_overloaded_roofline_run_changes_no_result(monkeypatch, spp, qps, caching) -> None:
    # sim_speed's setting, shorter: long prompts at a high load build a long queue
    trace = generate(WorkloadSpec(qps=qps, num_requests=300, long_fraction=0.2, seed=spp))
    spec = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=spp,
        target_batch_time=0.05,
        prefix_caching=caching,
    )
    counts = _count_scan_turns(monkeypatch)
    fast = simulate_with_skips(trace, spec, 16)
    taken = dict(counts)
    assert_same_results(fast, simulate_with_skips(trace, spec, 16, turn_scans=False))
    assert_same_results(fast, simulate_with_skips(trace, spec, 16, turn_runs=False))
    assert taken["pairs"] > 200, taken


def test_scan_turns_off_forms_every_such_batch_in_schedule(monkeypatch) -> None:
    spec = RunSpec(policy="lars-mp", tp=8, spp=2, long_threshold=16_384)
    trace = mixed_long_short_trace(0, longs=20, shorts=60)
    counts = _count_scan_turns(monkeypatch)
    simulate_with_skips(trace, spec, 16, turn_scans=False)
    assert counts == {"pairs": 0, "run_plain": 0, "scan_turns": 0, "scan_plain": 0}


def _finished_states(monkeypatch) -> dict[str, tuple]:
    """Each request's scheduler fields as it finishes (``Scheduler._finish``)."""
    states: dict[str, tuple] = {}
    finish = Scheduler._finish

    def record(self, request, status):
        states[request.request_id] = (
            request.first_scheduled_time,
            request.num_preemptions,
            request.num_cached_tokens,
            request.num_prefill_tokens,
            request.num_scheduled_tokens,
            request.num_computed_tokens,
            len(request.output_token_ids),
            request.total_work,
            request.remaining_work,
        )
        finish(self, request, status)

    monkeypatch.setattr(Scheduler, "_finish", record)
    return states


def test_scan_turns_leave_every_request_as_schedule_does(monkeypatch) -> None:
    # a short prompt that a scan turn admits is first scheduled at that turn
    # (the records do not show it: compare the requests themselves)
    trace = generate(WorkloadSpec(qps=2.0, num_requests=300, long_fraction=0.2, seed=2))
    spec = RunSpec(policy="lars-mp", cost_model="roofline:model=llama3-8b,gpu=a100", tp=8, spp=2)
    states = _finished_states(monkeypatch)
    simulate_with_skips(trace, spec, 16)
    fast = dict(states)
    states.clear()
    simulate_with_skips(trace, spec, 16, turn_scans=False)
    assert len(fast) == len(trace)
    assert fast == states
