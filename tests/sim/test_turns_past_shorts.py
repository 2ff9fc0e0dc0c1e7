"""Prefill turns of long prompts taken while short prompts wait out of the scan's reach.

``Scheduler.turn_run`` (and ``turns_prefill``, which opens a run) take the
turn of the queue's first prompt, long, beside the ready decodes while short
prompts are queued when ``Scheduler._shorts_out_of_reach`` holds (and so
does ``prefill_turn``, the per-turn path): the proof
with which ``_pack_prefills`` stops its own scan after that chunk
(``_PrefillQueue.ahead_of_not_long``: more than ``max_consecutive_skips`` long
prompts surely come before every short one). These tests check

- that the proof never holds where the full scan (its early stop off) would
  form any other batch than the first prompt's chunk beside the decodes, at
  every ``schedule()`` of mixed simulations;
- whole simulations with such turns against the same simulations without
  them (the proof never tried in the turns, so ``schedule()`` forms those
  batches), against the per-turn path (``turn_runs=False``: ``prefill_turn``
  takes the same turns one at a time) and against one batch at a time
  (``decode_runs=False``): every record, batch and float the same, and many
  turns taken past short prompts.
"""

from __future__ import annotations

import pytest

from medha_sched.scheduler import Scheduler, _PrefillQueue
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sim.same import MIXED_CASES, assert_same_results
from tests.sim.same import mixed_long_short_trace as _mixed_trace
from tests.sim.same import simulate_with_skips as _run

_AHEAD = _PrefillQueue.ahead_of_not_long
_OUT_OF_REACH = Scheduler._shorts_out_of_reach
_TURN_RUN = Scheduler.turn_run


def _count_turns_past_shorts(monkeypatch) -> dict[str, int]:
    """Turns ``turn_run`` took with a short prompt queued at the turn's time."""
    counts = {"turns": 0}

    def counting(self, request, now, horizon, free, ends_before):
        shorts = []  # whether a short prompt was queued at each turn (read at its proof)

        def noting(first, at):
            got = _OUT_OF_REACH(self, first, at)
            shorts.append(got)
            return got

        self._shorts_out_of_reach = noting
        try:
            got = _TURN_RUN(self, request, now, horizon, free, ends_before)
        finally:
            del self._shorts_out_of_reach
        if got is not None:
            # each turn past short prompts follows a proof that held; the
            # run's last proof may have held for a turn stopped on another
            # ground (counted low)
            counts["turns"] += min(len(got.ids), max(0, sum(shorts) - 1))
        return got

    monkeypatch.setattr(Scheduler, "turn_run", counting)
    return counts


def _never_past_shorts(self, first, now) -> bool:
    return False  # the turns stop wherever a short prompt is queued: schedule() decides


@pytest.mark.parametrize(
    ("policy", "skips", "spp", "seed"),
    MIXED_CASES,
)
def test_turns_past_short_prompts_change_no_result(monkeypatch, policy, skips, spp, seed) -> None:
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = _mixed_trace(seed, longs=3 * skips + 6, shorts=90)
    counts = _count_turns_past_shorts(monkeypatch)
    fast = _run(trace, spec, skips)
    assert all(r.finish_s is not None for r in fast.records)
    assert counts["turns"] > 20  # many turns went past queued short prompts
    # every turn on its own (prefill_turn), and every batch through schedule()
    assert_same_results(fast, _run(trace, spec, skips, turn_runs=False))
    assert_same_results(fast, _run(trace, spec, skips, decode_runs=False))
    monkeypatch.setattr(Scheduler, "_shorts_out_of_reach", _never_past_shorts)
    assert_same_results(fast, _run(trace, spec, skips))


@pytest.mark.parametrize("spp", [2, 4])
def test_an_overloaded_roofline_run_changes_no_result(monkeypatch, spp) -> None:
    # sim_speed's setting, shorter: 30% long prompts at 2 QPS build a long queue
    trace = generate(WorkloadSpec(qps=2.0, num_requests=200, long_fraction=0.3, seed=2))
    spec = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=spp,
        target_batch_time=0.05,
    )
    counts = _count_turns_past_shorts(monkeypatch)
    fast = _run(trace, spec, 16)
    assert counts["turns"] > 200
    monkeypatch.setattr(Scheduler, "_shorts_out_of_reach", _never_past_shorts)
    assert_same_results(fast, _run(trace, spec, 16))


@pytest.mark.parametrize(
    ("policy", "skips", "spp", "seed"),
    [("lars-mp", 16, 2, 0), ("lars-mp", 4, 2, 1), ("lars", 3, 3, 2), ("edf", 6, 2, 3)],
)
def test_the_proof_holds_only_where_the_full_scan_forms_the_first_chunk_alone(
    monkeypatch, policy, skips, spp, seed
) -> None:
    """At every ``schedule()`` (no turns, the scan's early stop off so that it
    walks to its end): where the first queued prompt is long, admitted and in
    one KVP group, and the proof holds with short prompts queued, the batch
    must be the decodes and a chunk of that prompt alone (its last chunk too,
    which the turns leave to ``schedule()``)."""
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = _mixed_trace(seed, longs=3 * skips + 6, shorts=90)
    checked = {"held": 0, "joined": 0}
    plain = Scheduler.schedule_plain
    proving = [False]  # the proof's ahead_of_not_long answers; the scan's answer 0

    def ahead(self, request_ids, now):
        return _AHEAD(self, request_ids, now) if proving[0] else 0

    def checking(self, now):
        queue = self._queue
        first = queue.first(now)
        held = False
        if (
            first is not None
            and queue.num_not_long
            and first.request_id in self._running
            and first.request_id not in self._lanes
        ):
            proving[0] = True
            try:
                held = _OUT_OF_REACH(self, first, now)
            finally:
                proving[0] = False
        got = plain(self, now)
        if held:
            checked["held"] += 1
            chunks = got[3]
            if chunks:  # else no chunk of it fitted: the turn would not go either
                checked["joined"] += 1
                assert len(chunks) == 1 and chunks[0][0] == first.request_id, (now, chunks)
        return got

    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long", ahead)
    monkeypatch.setattr(Scheduler, "schedule_plain", checking)
    result = _run(trace, spec, skips, decode_runs=False)  # every batch through schedule()
    assert all(r.finish_s is not None for r in result.records)
    assert checked["joined"] > 20, checked  # the proof held, and was checked, many times
