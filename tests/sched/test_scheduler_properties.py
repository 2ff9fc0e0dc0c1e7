"""Scheduling invariants over random workloads and random monotone cost models.

Every batch of every run is checked by ``harness.Checker``: token
conservation, no duplicates, decodes first, the time budget, search
optimality, at most one long prefill per KVP group, chunks inside their
shard, memory bounds and exactly-once frees, fixed deadlines. Each run must
also finish every request (liveness).
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .harness import run
from .strategies import setups, workloads

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_invariants_hold_and_every_request_finishes(data) -> None:
    sched = data.draw(setups())
    requests = data.draw(workloads(sched))
    trace = run(sched, requests)
    assert set(trace.finished) == {r.request_id for r in requests}
    for r in trace.finished.values():
        assert r.num_output_tokens == r.max_output_tokens
    assert sched.memory.usage() == 0.0
    sched.memory.check_invariants()


@SETTINGS
@given(data=st.data())
def test_tight_memory_preempts_by_recompute_and_still_finishes(data) -> None:
    sched = data.draw(setups(adaptive=True, tight_memory=True))
    requests = data.draw(workloads(sched, heavy=True))
    trace = run(sched, requests)
    assert set(trace.finished) == {r.request_id for r in requests}
    preempted = {rid for out in trace.outputs for rid in out.preempted}
    for rid in preempted:
        assert trace.finished[rid].num_preemptions >= 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_same_input_gives_same_schedule(data) -> None:
    sched = data.draw(setups())
    requests = data.draw(workloads(sched))
    twin = copy.deepcopy(sched)
    first = run(sched, copy.deepcopy(requests))
    second = run(twin, copy.deepcopy(requests))
    assert first.outputs == second.outputs
