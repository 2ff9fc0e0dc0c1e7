"""``Scheduler.turn_run`` prices a lane alone in a non-scan turn only where it must.

The two facts that let it skip the price, for the roofline's chunk price:

- the chunk search's answer does not depend on the time its secant starts
  from (``base_time``): it returns the largest candidate within the target,
  whatever the probes it makes on the way;
- a chunk's price is at least its lane's alone (``group_time`` of the lane's
  sums): every operation of the price is monotone in floats, so a chunk found
  within the goal proves the lane's time below it.

And the runs, with the lane priced late, must give the results of the runs that
price it first at every turn (``Scheduler._lane_time_late = False``) and of the
per-turn path, while pricing far fewer lanes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.chunking import largest_chunk_priced
from medha_sched.config import ParallelDegrees
from medha_sched.cost.roofline import RooflineCostModel
from medha_sched.scheduler import Scheduler
from medha_sched.sim import TraceRequest
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sim.same import assert_same_results, paper_spec, simulate

_MODEL = RooflineCostModel.from_spec(
    {"model": "llama3-8b", "gpu": "a100"}, layout=ParallelDegrees(tp=8, spp=2, kvp=1)
)
_PRICE = _MODEL.chunk_price()


def _lane(nt: int, kv: int) -> list[float]:
    """A one-group lane's sums: ``nt`` decodes whose KV adds up to ``kv``."""
    a = _MODEL.features(1, 0, True)
    b = [x - y for x, y in zip(_MODEL.features(1, 1, True), a, strict=True)]
    return [nt * x + kv * y for x, y in zip(a, b, strict=True)]


_lanes = st.one_of(
    st.none(),
    st.builds(_lane, st.integers(1, 256), st.integers(0, 2_000_000)),
    st.lists(st.floats(0.0, 1e7), min_size=6, max_size=6),  # any sums of features
)


@settings(max_examples=400, deadline=None)
@given(
    base=_lanes,
    start=st.integers(0, 1_000_000),
    limit=st.integers(1, 20_000),
    grid=st.sampled_from([1, 16, 32, 128]),
    target=st.floats(0.0, 0.2),
    hint=st.integers(0, 20_000),
    t0=st.floats(0.0, 0.2),
)
def test_the_search_answer_does_not_depend_on_where_its_secant_starts(
    base, start, limit, grid, target, hint, t0
) -> None:
    true_t0 = 0.0 if base is None else _MODEL.group_time(base)
    want = _PRICE.search(limit, grid, base, start, target, true_t0, hint)
    assert _PRICE.search(limit, grid, base, start, target, 0.0, hint) == want
    assert _PRICE.search(limit, grid, base, start, target, t0, hint) == want
    assert largest_chunk_priced(limit, grid, _PRICE, base, start, target, 0.0, hint) == want


@settings(max_examples=400, deadline=None)
@given(
    base=_lanes.filter(lambda b: b is not None),
    start=st.integers(0, 1_000_000),
    n=st.integers(1, 20_000),
)
def test_a_chunk_costs_at_least_its_lane_alone(base, start, n) -> None:
    lane = _MODEL.group_time(base)
    assert _PRICE(base, start, n) >= lane
    found, time = _PRICE.search(n, 1, base, start, 1e9, 0.0, n)
    assert found == n and time == _PRICE(base, start, n) >= lane


def _trace() -> list[TraceRequest]:
    """Long prompts (some waiting together) beside decodes of many lengths."""
    longs = [
        TraceRequest(f"long{i}", 0.4 + 2.0 * i * (i % 2), 60_000 + 25_000 * i, 4 + i)
        for i in range(5)
    ]
    shorts = [
        TraceRequest(f"s{i}", 0.1 + 0.21 * i, 150 + 61 * (i % 9), 3 + 19 * (i % 7))
        for i in range(70)
    ]
    return sorted(longs + shorts, key=lambda r: (r.arrival_s, r.id))


def _count_lane_prices(monkeypatch) -> dict[str, int]:
    """Count the calls of the kept decode time functions (a lane priced alone)."""
    counts = {"lanes": 0}
    made = Scheduler._decode_time_of

    def counting(self, base):  # type: ignore[no-untyped-def]
        time_of = made(self, base)

        def counted(pairs: float, kv: float) -> float:
            counts["lanes"] += 1
            return time_of(pairs, kv)

        return counted

    monkeypatch.setattr(Scheduler, "_decode_time_of", counting)
    return counts


def test_runs_pricing_lanes_late_same_results(monkeypatch) -> None:
    for trace, spec in (
        (_trace(), paper_spec(long_threshold=16_384)),
        (_trace(), paper_spec(policy="edf", spp=3, long_threshold=16_384)),
        (
            generate(WorkloadSpec(qps=1.5, num_requests=150, long_fraction=0.08, seed=3)),
            paper_spec(),
        ),
    ):
        per_turn = simulate(trace, spec, turn_runs=False)
        monkeypatch.setattr(Scheduler, "_lane_time_late", False)
        counts = _count_lane_prices(monkeypatch)
        first = simulate(trace, spec)
        priced_first = counts["lanes"]
        monkeypatch.undo()
        counts = _count_lane_prices(monkeypatch)
        late = simulate(trace, spec)
        assert_same_results(late, first)
        assert_same_results(late, per_turn)
        # many lanes went unpriced (the scans and the per-turn path still price theirs;
        # here 305 -> 158, 211 -> 88 and 7,388 -> 1,096 lanes)
        assert priced_first > 200 and counts["lanes"] < priced_first * 3 // 5
        monkeypatch.undo()
