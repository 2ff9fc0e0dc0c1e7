"""The roofline's ``group_time_varying(...).series``: a whole decode run priced
in one call, float for float the loop of ``DecodeLanes.one_group_times``
calling the function step by step (with and without a budget that stops
it), over lanes of many sizes and the layouts the roofline prices."""

from __future__ import annotations

import random

import pytest

from medha_sched.config import ParallelDegrees
from medha_sched.cost.roofline import RooflineCostModel
from medha_sched.decode_set import ZERO_TOKENS
from medha_sched.output import BatchResult
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler
from medha_sched.sim.runner import RunSpec

ROOFLINE = "roofline:model=llama3-8b,gpu=a100"


def _step_by_step(model: RooflineCostModel):
    """The model's ``group_time_varying`` without ``series``: one_group_times
    then calls the function at each step (its loop)."""

    def varying(row, i, j):
        time_of = model.group_time_varying(row, i, j)
        if time_of is None:
            return None
        assert callable(time_of.series)  # what the fast path takes

        def plain(pairs: float, kv: float) -> float:
            return time_of(pairs, kv)

        return plain

    return varying


@pytest.mark.parametrize("members", [1, 5, 33])
@pytest.mark.parametrize("spp", [1, 2])
def test_series_equals_the_loop(members: int, spp: int) -> None:
    config, model, cache = RunSpec(policy="lars-mp", cost_model=ROOFLINE, tp=8, spp=spp).build()
    assert isinstance(model, RooflineCostModel)
    s = Scheduler(config, model, cache=cache)
    rng = random.Random(members * 10 + spp)
    for i in range(members):
        s.add_request(Request(f"r{i}", 0.0, rng.randint(10, 9_000), 100_000))
    now = 0.0
    while s.num_queued:
        out = s.schedule(now)
        s.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=ZERO_TOKENS))
        now += 0.05
    lanes = s._lanes
    lane = lanes.gather()
    assert lane is not None and len(lane.members) == members
    slow = lanes.one_group_times(lane, model.group_time, 3_000, varying=_step_by_step(model))
    fast = lanes.one_group_times(lane, model.group_time, 3_000, varying=model.group_time_varying)
    assert fast == slow and len(fast) == 3_000
    spent, sums = 0.0, []
    for t in slow:  # the running sums as the loop adds them
        spent += t
        sums.append(spent)
    for cut in (0, 1, 77, 2_999):
        for budget, stop in ((sums[cut], cut + 1), (sums[cut] + 1e-12, cut + 2)):
            got = lanes.one_group_times(
                lane, model.group_time, 3_000, budget, varying=model.group_time_varying
            )
            want = lanes.one_group_times(
                lane, model.group_time, 3_000, budget, varying=_step_by_step(model)
            )
            assert got == want == slow[: min(stop, 3_000)]  # the step reaching it included


def test_series_equals_time_of_on_random_totals() -> None:
    """Any totals and run parameters (the layouts' coefficients differ)."""
    rng = random.Random(5)
    for tp, spp, kvp in [(1, 1, 1), (8, 2, 1), (8, 4, 2), (2, 1, 4)]:
        model = RooflineCostModel.from_spec(
            {"model": "llama3-8b", "gpu": "a100"}, layout=ParallelDegrees(tp=tp, spp=spp, kvp=kvp)
        )
        for _ in range(300):
            row = [rng.choice([0, rng.randint(1, 300)]), 0, 0, rng.randint(0, 300), 0, 1]
            row[4] = rng.choice([0, rng.randint(1, 5_000)])
            time_of = model.group_time_varying(row, 1, 2)
            nt = row[0]
            ai, bi, ci = nt * rng.uniform(0, 3), rng.choice([0, 1, 2]), rng.randint(0, 10**6)
            aj, bj, cj = nt * rng.uniform(0, 3), rng.choice([0, 1]), rng.randint(0, 10**4)
            kv_sum, first, steps = rng.randint(0, 10**7), rng.randint(0, 5_000), 40
            want = []
            for step in range(first, first + steps):
                kv = kv_sum + nt * step
                want.append(time_of(ai + kv * bi + ci, aj + kv * bj + cj))
            got = time_of.series(ai, bi, ci, aj, bj, cj, kv_sum, nt, first, steps, float("inf"))
            assert got == want
