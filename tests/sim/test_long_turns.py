"""Long prompts waiting together take their chunks in turns without ``schedule()``.

When every queued prompt is long, the first one's long chunk fills every KVP
group and the scan stops after it, so ``Scheduler.prefill_turn(None, ...)``
issues that chunk (beside the ready decodes) without the scan. The simulation
must give the same per-request and per-iteration records as going one batch
at a time (``decode_runs=False``), and the turns must really be taken, by
more than one prompt (LARS alternates between long prompts as their slack
changes).
"""

from __future__ import annotations

import dataclasses

import pytest

from medha_sched.request import Request
from medha_sched.scheduler import Scheduler
from medha_sched.sim import TraceRequest, simulate
from medha_sched.sim.runner import RunSpec


def _trace() -> list[TraceRequest]:
    longs = [TraceRequest(f"long{i}", 0.05 * i, 40_000 + 7_000 * i, 3 + i) for i in range(4)]
    shorts = [TraceRequest(f"s{i}", 0.3 + 0.9 * i, 200 + 50 * i, 20 + 7 * i) for i in range(10)]
    return sorted(longs + shorts, key=lambda r: r.arrival_s)


@pytest.mark.parametrize(
    ("policy", "spp", "kvp", "per_group"),
    [("lars-mp", 2, 1, None), ("lars", 4, 1, None), ("lars-mp", 2, 2, 32_768), ("edf", 2, 1, None)],
)
def test_long_prompts_waiting_together_same_results(
    monkeypatch, policy, spp, kvp, per_group
) -> None:
    """KVP 2: a prompt's chunks fill both groups only from its second shard on."""
    spec = RunSpec(
        policy=policy,
        tp=8,
        spp=spp,
        kvp=kvp,
        max_tokens_per_group=per_group,
        long_threshold=16_384,
    )
    config, model, cache = spec.build()
    owners: list[str] = []
    shared: list[int] = []
    turn = Scheduler.prefill_turn

    def counting(self, request, now):
        got = turn(self, request, now)
        if got is not None and request is None:
            shared.append(got[1])
            owners.append(self._in_flight[got[0]].entries[0][0].request_id)
        return got

    monkeypatch.setattr(Scheduler, "prefill_turn", counting)
    trace = _trace()
    off = simulate(trace, config, model, cache=cache, decode_runs=False)
    assert not shared  # one batch at a time: no turns
    # every turn on its own (runs of turns: tests/sim/test_turn_runs.py)
    on = simulate(trace, config, model, cache=cache, decode_runs=True, turn_runs=False)
    assert [dataclasses.astuple(r) for r in on.records] == [
        dataclasses.astuple(r) for r in off.records
    ]
    assert on.iterations == off.iterations
    assert on.end_s == off.end_s
    assert all(r.finish_s is not None for r in on.records)
    with_prefill = sum(1 for it in off.iterations if it.prefill_chunks)
    assert len(shared) > with_prefill // (4 * kvp)  # many chunks went as shared turns
    if policy.startswith("lars"):
        assert len(set(owners)) > 1  # the first prompt changed between turns


def test_no_shared_turn_while_a_short_prompt_waits() -> None:
    spec = RunSpec(policy="edf", tp=8, spp=2, long_threshold=16_384)
    config, model, cache = spec.build()
    s = Scheduler(config, model, cache=cache)
    s.add_request(Request("a", 0.0, 40_000, 4))
    s.add_request(Request("b", 0.0, 50_000, 4))
    out = s.schedule(0.0)
    assert len(out.prefill_chunks) == 1  # one long prefill per KVP group
    s.on_stage_end(out.batch_id)
    assert s.turns_prefill() is None  # others wait: the time is needed
    assert s.turns_prefill(0.1) is s.get_request("a")  # the earlier deadline, admitted
    s.add_request(Request("c", 0.1, 300, 4))  # a short prompt could join: schedule() decides
    assert s.turns_prefill(0.1) is None
    assert s.prefill_turn(None, 0.1) is None
