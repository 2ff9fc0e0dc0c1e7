"""``turn_run``'s scan turns build their draft at once.

Where the model prices a chunk in one call, a scan turn's draft (the ready
lane's decodes, then the first queued prompt's chunk, whose price the chunk
search found) is built by ``Scheduler._joined_draft`` (``BatchCost.tail_batch``)
instead of ``_new_draft``, ``seed_priced``, ``set_decodes``, ``note_tail`` and
``_join``. Every such draft in whole simulations is checked against the one
those steps build: every field, and the cost's totals, times and probes.
"""

from __future__ import annotations

import pytest

from medha_sched.batch_cost import BatchCost
from medha_sched.scheduler import Scheduler
from medha_sched.sim.engine import Simulator
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate

_JOINED = Scheduler._joined_draft


def _state(draft) -> tuple:
    cost = draft.cost
    return (
        [(r.request_id, n) for r, n in draft.entries],
        draft.target,
        draft.num_decodes,
        draft.held_decodes,
        draft.long_groups,
        draft.groups,
        draft.num_tokens,
        draft.num_prefills,
        draft.misses,
        draft.floor,
        draft.fits_somewhere,
        cost.time,
        cost._totals,
        cost._group_times,
        cost._probes,
        cost._items,
        cost._num_groups,
        cost._price is not None,
    )


def _stepwise(self, request, groups, n, time, base, decodes, is_long):
    """The draft as the steps ``_joined_draft`` stands for build it."""
    draft = self._new_draft()
    if decodes:  # a lane (turn_run seeds it: its totals, None when it has no work)
        draft.cost.seed_priced(base, 0.0 if base is None else self.cost_model.group_time(base))
        draft.set_decodes(decodes)
    draft.cost.note_tail(groups[0], n, request.num_scheduled_tokens, time)
    self._join(draft, request, groups, n, is_long)
    return draft


@pytest.mark.parametrize(("qps", "spp", "seed"), [(2.0, 2, 2), (1.75, 4, 3), (0.5, 2, 1)])
def test_joined_drafts_are_the_steps_drafts(monkeypatch, qps, spp, seed) -> None:
    checked = {"drafts": 0, "lanes": 0, "long": 0}

    def twin(self, request, groups, n, time, base, decodes, is_long):
        got = _JOINED(self, request, groups, n, time, base, decodes, is_long)
        want = _stepwise(self, request, groups, n, time, base, decodes, is_long)
        assert _state(got) == _state(want)
        # the search's time is the summed totals' price (what add() would find)
        assert time == self.cost_model.group_time(got.cost._totals[0])
        checked["drafts"] += 1
        checked["lanes"] += decodes > 0
        checked["long"] += is_long
        return got

    monkeypatch.setattr(Scheduler, "_joined_draft", twin)
    spec = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=spp,
        target_batch_time=0.05,
    )
    config, model, cache = spec.build()
    trace = generate(WorkloadSpec(qps=qps, num_requests=200, long_fraction=0.3, seed=seed))
    Simulator(config, model, cache=cache).run(trace)
    assert checked["drafts"] > 100 and checked["lanes"] > 50 and checked["long"] > 50, checked


def test_tail_batch_without_a_lane_sums_the_chunk_alone() -> None:
    spec = RunSpec(policy="lars-mp", cost_model="roofline:model=llama3-8b,gpu=a100", tp=8)
    _, model, _ = spec.build()
    price = model.chunk_price()
    kept, two = BatchCost(model, 1, price=price), BatchCost(model, 1, price=price)
    time = price(None, 100, 64)
    one = kept.tail_batch(None, (0, 64, 100, True), time)
    two.note_tail(0, 64, 100, time)
    two.add([(0, 64, 100, True)])
    assert (one.time, one._totals, one._group_times, one._probes) == (
        two.time,
        two._totals,
        two._group_times,
        two._probes,
    )
    assert one._totals[0] == list(model.features(64, 100, True))
