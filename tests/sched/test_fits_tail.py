"""A chunk at KV 0 told to fit by the roofline's growth bound, not priced.

``chunk_price().fits_after(time, n, target)`` claims that an ``n``-token tail
chunk at KV 0 added to a base of non-negative totals whose own price is
``time`` prices within ``target``; ``BatchCost.fits_tail`` asks it for a
one-group batch, and ``Scheduler._lower_floor`` then records the chunk as
fitting without pricing it. These tests check the claim against the price
itself on random bases (targets at, and one ulp around, the price and the
bound), that it is told often, and that ``_lower_floor`` leaves the draft as
the priced probe leaves it.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.batch_cost import BatchCost
from medha_sched.config import ParallelDegrees
from medha_sched.cost import RooflineCostModel
from medha_sched.cost.registry import parse_cost_model_spec

LAYOUTS = [ParallelDegrees(tp=8, spp=2), ParallelDegrees(tp=1, spp=1), ParallelDegrees(tp=2, spp=4)]


def _model(i: int) -> RooflineCostModel:
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=a100", layout=LAYOUTS[i])
    assert isinstance(model, RooflineCostModel)
    return model


MODELS = [_model(i) for i in range(len(LAYOUTS))]

_base = st.one_of(
    # a lane's decodes (one tail token each) and maybe a chunk beside them
    st.tuples(
        st.lists(st.integers(1, 400_000), min_size=1, max_size=60),
        st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 200_000)), max_size=2),
    ),
)


def _totals(model: RooflineCostModel, kvs: list[int], chunks: list[tuple[int, int]]) -> list:
    feats = [model.features(1, kv, True) for kv in kvs]
    feats += [model.features(n, start, True) for n, start in chunks]
    return [sum(col) for col in zip(*feats, strict=True)]


@settings(max_examples=400, deadline=None)
@given(
    which=st.integers(0, len(LAYOUTS) - 1),
    base=_base,
    n=st.sampled_from([1, 16, 32, 64, 100, 512, 4096]) | st.integers(1, 8192),
    pick=st.integers(0, 5),
)
def test_fits_after_never_claims_a_chunk_over_the_target(which, base, n, pick) -> None:
    model = MODELS[which]
    price = model.chunk_price()
    fits_after = price.fits_after
    totals = _totals(model, *base)
    time = model.group_time(totals)
    real = price(totals, 0, n)
    # targets at and around the chunk's own price, and others
    targets = [real, math.nextafter(real, 0.0), math.nextafter(real, math.inf), real * 1.5]
    targets += [time, time * 1.001, 0.05, real * 0.999]
    target = targets[pick] if pick < 4 else targets[4 + pick % 4]
    for t in [target, math.nextafter(target, 0.0), math.nextafter(target, math.inf)]:
        told = fits_after(time, n, t)
        if told is True:
            assert real <= t, (totals, n, t)
        elif told is False:
            assert real > t, (totals, n, t)


def test_fits_after_is_told_for_most_chunks_well_inside_the_target() -> None:
    model = MODELS[0]
    price = model.chunk_price()
    told = 0
    for i in range(200):
        totals = _totals(model, [1000 + 37 * k for k in range(1 + i % 50)], [(512, 100 * i)])
        time = model.group_time(totals)
        target = price(totals, 0, 32) * 1.2
        assert price(totals, 0, 32) <= target
        told += price.fits_after(time, 32, target)
    assert told >= 150
    # at the chunk's own price, or with an infinite or NaN time, nothing is told
    totals = _totals(model, [1000], [])
    time = model.group_time(totals)
    assert price.fits_after(time, 32, price(totals, 0, 32)) is None
    assert price.fits_after(math.inf, 32, 1.0) is False  # (an infinite time is over)
    assert price.fits_after(math.nan, 32, 1.0) is None
    # and told over where the target is under the base's time
    assert price.fits_after(time, 32, time * 0.999) is False


def test_batch_cost_fits_tail_needs_a_bound_and_totals() -> None:
    model = MODELS[0]
    cost = BatchCost(model, 1, price=model.chunk_price())
    assert cost.fits_tail(32, 1.0) is None  # empty: nothing to add to
    cost.add([(0, 512, 0, True)])
    assert cost.fits_tail(32, 1.0) is True
    assert cost.fits_tail(32, cost.time) is False
    assert cost.empty().fits_tail(32, 1.0) is None
    plain = BatchCost(model, 1)  # no price: nothing told
    plain.add([(0, 512, 0, True)])
    assert plain.fits_tail(32, 1.0) is None


def _lower_floor_calls(monkeypatch, told: bool) -> dict[str, int]:
    """Count the floor probes; ``told`` False turns the bound off (every probe priced)."""
    counts = {"told": 0, "priced": 0}
    fits = BatchCost.fits_tail
    priced = BatchCost.time_with_tail

    def fits_tail(self, q_tokens, target):  # type: ignore[no-untyped-def]
        ok = fits(self, q_tokens, target) if told else None
        counts["told"] += ok is not None
        return ok

    def time_with_tail(self, group, q_tokens, kv_tokens):  # type: ignore[no-untyped-def]
        counts["priced"] += 1
        return priced(self, group, q_tokens, kv_tokens)

    monkeypatch.setattr(BatchCost, "fits_tail", fits_tail)
    monkeypatch.setattr(BatchCost, "time_with_tail", time_with_tail)
    return counts


def test_runs_with_the_floor_told_by_the_bound_same_results(monkeypatch) -> None:
    from medha_sched.sim.workload import WorkloadSpec, generate
    from tests.sim.same import assert_same_results, mixed_long_short_trace, paper_spec, simulate

    for trace, spec in (
        (mixed_long_short_trace(7, 8, 120), paper_spec(long_threshold=16_384)),
        (
            generate(WorkloadSpec(qps=1.5, num_requests=200, long_fraction=0.08, seed=5)),
            paper_spec(),
        ),
        (
            generate(WorkloadSpec(qps=3.0, num_requests=200, long_fraction=0.05, seed=9)),
            paper_spec(spp=4),
        ),
    ):
        counts = _lower_floor_calls(monkeypatch, told=False)
        priced = simulate(trace, spec)
        every = counts["priced"]
        monkeypatch.undo()
        counts = _lower_floor_calls(monkeypatch, told=True)
        bound = simulate(trace, spec)
        monkeypatch.undo()
        assert_same_results(bound, priced)
        assert counts["told"] > 0 and counts["priced"] == every - counts["told"]
