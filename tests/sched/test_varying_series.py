"""The roofline's ``group_time_varying(...).series``: a whole decode run priced
in one call, float for float the loop of ``DecodeLanes.one_group_times``
calling the function step by step (with and without a budget that stops
it), over lanes of many sizes and the layouts the roofline prices."""

from __future__ import annotations

import math
import random
from itertools import accumulate

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.config import ParallelDegrees
from medha_sched.cost.roofline import RooflineCostModel, _memory_bound_run
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


def _loop(time_of, args) -> list[float]:
    """``series``' contract step by step: ``time_of`` at each step, stopping at
    the first running sum reaching the budget (included)."""
    ai, bi, ci, aj, bj, cj, kv_sum, nt, first, steps, budget = args
    times, spent = [], 0.0
    for step in range(first, first + steps):
        kv = kv_sum + nt * step
        t = time_of(ai + kv * bi + ci, aj + kv * bj + cj)
        times.append(t)
        spent += t
        if spent >= budget:
            break
    return times


_LAYOUTS = [(1, 1, 1), (8, 2, 1), (8, 4, 2), (2, 1, 4)]


@settings(max_examples=400, deadline=None)
@given(
    layout=st.sampled_from(_LAYOUTS),
    nt=st.integers(1, 300),
    qa_extra=st.integers(0, 300),
    qm=st.sampled_from([0, 1, 4_000]),
    ci=st.sampled_from([0, 1, 10**4, 10**6, 10**8, 10**10]),
    cj=st.integers(0, 10**5),
    bi=st.sampled_from([0, 1, 2]),
    bj=st.sampled_from([0, 1, 2]),
    kv_sum=st.integers(0, 10**7),
    first=st.integers(0, 5_000),
    steps=st.integers(0, 300),
    cut=st.floats(0.0, 1.2),
    nudge=st.sampled_from([-1, 0, 1]),
)
def test_memory_bound_fast_path_equals_the_loop(
    layout, nt, qa_extra, qm, ci, cj, bi, bj, kv_sum, first, steps, cut, nudge
) -> None:
    """Integer runs (the fast path where the memory branch is proved to win,
    the general loop where it is not: large attended pairs cross over), with
    budgets on, just under and just over a running sum, none, and odd ones."""
    tp, spp, kvp = layout
    model = RooflineCostModel.from_spec(
        {"model": "llama3-8b", "gpu": "a100"}, layout=ParallelDegrees(tp=tp, spp=spp, kvp=kvp)
    )
    row = [nt, 0, 0, nt + qa_extra, qm, nt]
    time_of = model.group_time_varying(row, 1, 2)
    args = [nt, bi, ci, nt, bj, cj, kv_sum, nt, first, steps, float("inf")]
    whole = _loop(time_of, args)
    sums = list(accumulate(whole))
    budgets = [float("inf"), float("nan"), float("-inf"), 0.0, -1.0]
    if sums:
        k = min(int(cut * len(sums)), len(sums) - 1)
        budgets.append(sums[k])
        budgets.append(math.nextafter(sums[k], math.inf * nudge) if nudge else sums[k] * cut)
        budgets.append(sums[-1] * 2)
    for budget in budgets:
        args[-1] = budget
        assert time_of.series(*args) == _loop(time_of, args), budget


def test_memory_bound_run_is_taken_for_decodes() -> None:
    """The run the simulator prices (one group, decodes only) takes the fast
    path, and large attended pairs (the compute branch near) do not."""
    model = RooflineCostModel.from_spec(
        {"model": "llama3-8b", "gpu": "a100"}, layout=ParallelDegrees(tp=8, spp=2)
    )
    bounds = (model._layer[3], model._layer[4], 20 * model._layer[5])
    run = _memory_bound_run(20, 1, 0, 20, 1, 0, 60_000, 20, 100, 200, bounds)
    assert run == range(20 + 60_000 + 2_000, 20 + 60_000 + 2_000 + 200 * 20, 20)
    assert _memory_bound_run(20, 1, 10**12, 20, 1, 0, 60_000, 20, 100, 200, bounds) is None
    assert _memory_bound_run(20.0, 1, 0, 20, 1, 0, 60_000, 20, 100, 200, bounds) is None
    assert _memory_bound_run(20, 1, 0, 20, 0, 0, 60_000, 20, 100, 200, bounds) is None


def test_memory_series_with_an_infinite_term_goes_step_by_step() -> None:
    """0 layers times an infinite term makes every time NaN: the running sums
    are then unsorted, so the bisection must not be used (the loop prices every
    step, as series' loop does when ``spent >= budget`` never holds)."""
    from medha_sched.cost.roofline import _memory_series

    inf = float("inf")
    #        qkv  b_kv read_q out  mlp merged fixed reduce layers pp_fixed send head
    terms = (1.0, 1e-6, 0.0, 1.0, 1.0, 0.0, inf, 1.0, 0.0, 1.0, 0.0, 1.0)
    times = _memory_series(range(100, 110), 10, 5.0, terms)
    assert len(times) == 10 and all(math.isnan(t) for t in times)
