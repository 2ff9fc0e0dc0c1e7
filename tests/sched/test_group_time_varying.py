"""``group_time_varying``: a group's time as a function of two totals, the
others fixed, equal float for float to ``group_time`` (the roofline's
attended pairs and KV tokens, which are what moves along a decode run), and
decode-run pricing with it equal to pricing without it.
"""

from __future__ import annotations

import random

import pytest

from medha_sched.config import ParallelDegrees
from medha_sched.cost.affine import AffineCostModel
from medha_sched.cost.roofline import RooflineCostModel
from medha_sched.decode_set import ZERO_TOKENS
from medha_sched.output import BatchResult
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler
from medha_sched.sim.runner import RunSpec

ROOFLINE = "roofline:model=llama3-8b,gpu=a100"


@pytest.mark.parametrize(("tp", "spp", "kvp"), [(1, 1, 1), (8, 2, 1), (8, 4, 2), (2, 1, 4)])
def test_roofline_varying_equals_group_time(tp: int, spp: int, kvp: int) -> None:
    model = RooflineCostModel.from_spec(
        {"model": "llama3-8b", "gpu": "a100"}, layout=ParallelDegrees(tp=tp, spp=spp, kvp=kvp)
    )
    rng = random.Random(tp * 100 + spp * 10 + kvp)
    compute_bound = memory_bound = 0
    for _ in range(3_000):
        row = [
            rng.choice([0, rng.randint(1, 300), rng.randint(1, 20_000)]),
            0,
            0,
            rng.choice([0, rng.randint(1, 300), rng.randint(1, 20_000)]),
            rng.choice([0, 0, rng.randint(1, 5_000)]),
            rng.choice([0, rng.randint(1, 300)]),
        ]
        time_of = model.group_time_varying(row, 1, 2)
        assert time_of is not None
        for _ in range(5):
            pairs = rng.choice([0, rng.randint(1, 10**6), rng.randint(1, 10**11)])
            kv = rng.choice([0, rng.randint(1, 10**4), rng.randint(1, 10**8)])
            row[1], row[2] = pairs, kv
            assert time_of(pairs, kv) == model.group_time(row)
            compute_bound += pairs > 10**9
            memory_bound += pairs < 10**6 and kv > 10**6
    assert compute_bound > 100 and memory_bound > 100


def test_varying_is_offered_only_where_it_applies() -> None:
    roofline = RooflineCostModel.from_spec({"model": "llama3-8b", "gpu": "a100"})
    row = [1, 2, 3, 4, 5, 6]
    assert roofline.group_time_varying(row, 0, 2) is None
    assert roofline.group_time_varying(row, 1, 3) is None
    affine = AffineCostModel(base=0.004, per_token=2e-5, per_attn=2e-10)
    assert affine.group_time_varying(row, 1, 2) is None


@pytest.mark.parametrize("members", [1, 7, 40])
def test_one_group_times_with_varying_equals_without(members: int) -> None:
    config, model, cache = RunSpec(policy="lars-mp", cost_model=ROOFLINE, tp=8, spp=2).build()
    assert isinstance(model, RooflineCostModel)
    s = Scheduler(config, model, cache=cache)
    for i in range(members):
        s.add_request(Request(f"r{i}", 0.0, 100 + 3_333 * i, 5_000))
    now = 0.0
    while s.num_queued:
        out = s.schedule(now)
        s.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=ZERO_TOKENS))
        now += 0.05
    lanes = s._lanes
    lane = lanes.gather()
    assert lane is not None and len(lane.members) == members
    plain = lanes.one_group_times(lane, model.group_time, 2_000)
    made = []

    def varying(row, i, j):  # the model's, noting that it gave a function
        time_of = model.group_time_varying(row, i, j)
        made.append(time_of is not None)
        return time_of

    fast = lanes.one_group_times(lane, model.group_time, 2_000, varying=varying)
    assert made == [True]
    assert fast == plain == [model.group_time(lanes.totals(lane, j)[0]) for j in range(2_000)]
    budget = sum(plain[:300]) - 1e-9
    assert (
        lanes.one_group_times(
            lane, model.group_time, 2_000, budget, varying=model.group_time_varying
        )
        == plain[:300]
    )


def test_varying_functions_are_kept_per_coefficients_and_totals() -> None:
    """The same fixed totals and coefficients give the same function back; other
    totals, their types, or another layout's coefficients give their own, each
    equal to ``group_time``."""
    models = [
        RooflineCostModel.from_spec(
            {"model": "llama3-8b", "gpu": "a100"}, layout=ParallelDegrees(tp=tp, spp=spp)
        )
        for tp, spp in ((8, 2), (8, 2), (2, 1))
    ]
    row = [20, 0, 0, 20, 0, 20]
    f = models[0].group_time_varying(row, 1, 2)
    assert models[1].group_time_varying(list(row), 1, 2) is f  # equal coefficients
    other_layout = models[2].group_time_varying(row, 1, 2)
    other_totals = models[0].group_time_varying([21, 0, 0, 21, 0, 21], 1, 2)
    as_floats = models[0].group_time_varying([20.0, 0, 0, 20, 0, 20], 1, 2)
    assert len({id(f), id(other_layout), id(other_totals), id(as_floats)}) == 4
    for model, fn, totals in (
        (models[0], f, row),
        (models[2], other_layout, row),
        (models[0], other_totals, [21, 0, 0, 21, 0, 21]),
        (models[0], as_floats, [20.0, 0, 0, 20, 0, 20]),
    ):
        for pairs, kv in ((70_020, 70_020), (10**11, 5)):
            assert fn(pairs, kv) == model.group_time([*totals[:1], pairs, kv, *totals[3:]])
