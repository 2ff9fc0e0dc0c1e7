"""``Scheduler.turn_run`` prices a lane's decodes with a function of the two
totals that move with the lane step (attended pairs and KV tokens), kept by
number of decodes (``Scheduler._decode_time_of``): the roofline's
``group_time_varying``, or ``group_time`` of the totals rebuilt where a model
has no such form. Either way every float must be ``group_time``'s: the runs
give the per-turn path's results, and each kept function answers as
``group_time`` does for its decode count at any KV length.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Sequence

from medha_sched.config import ParallelDegrees
from medha_sched.cost.roofline import RooflineCostModel
from medha_sched.sim import TraceRequest
from medha_sched.sim.engine import Simulator
from tests.sim.same import assert_same_results, paper_spec

SPEC = paper_spec(long_threshold=16_384)


class _OwnGroupTime(RooflineCostModel):
    """The roofline, its ``group_time`` overridden (the same floats): no
    ``group_time_varying`` and no ``chunk_price`` (a model pricing otherwise)."""

    def group_time(self, totals: Sequence[float]) -> float:
        return RooflineCostModel.group_time(self, totals)


def _trace() -> list[TraceRequest]:
    """Long prompts (three waiting together) among short requests that decode
    beside their chunks, with varied output lengths (lanes of varied sizes)."""
    longs = [
        TraceRequest(f"long{i}", 0.4 + 3.0 * i * (i % 2), 60_000 + 20_000 * i, 4 + i)
        for i in range(5)
    ]
    shorts = [
        TraceRequest(f"s{i}", 0.1 + 0.23 * i, 120 + 57 * (i % 11), 3 + 17 * (i % 7))
        for i in range(70)
    ]
    return sorted(longs + shorts, key=lambda r: (r.arrival_s, r.id))


def _simulator(model: RooflineCostModel | None = None, **flags) -> Simulator:
    config, roofline, cache = SPEC.build()
    return Simulator(config, model if model is not None else roofline, cache=cache, **flags)


def _row(model: RooflineCostModel, nt: int, kv: int) -> list[float]:
    """A one-group lane's totals: ``nt`` decodes whose KV adds up to ``kv``."""
    a = model.features(1, 0, True)
    b = [x - y for x, y in zip(model.features(1, 1, True), a, strict=True)]
    return [nt * x + kv * y for x, y in zip(a, b, strict=True)]


def test_kept_functions_answer_as_group_time() -> None:
    sim = _simulator()
    sim.run(_trace())
    sched, model = sim.sched, sim.sched.cost_model
    assert len(sched._decode_times) >= 5  # lanes of several sizes were priced
    rng = random.Random(5)
    for nt, time_of in sched._decode_times.items():
        for _ in range(50):
            kv = rng.choice([0, rng.randint(1, 10**4), rng.randint(1, 10**8)])
            row = _row(model, nt, kv)
            assert time_of(row[1], row[2]) == model.group_time(row)
    # kept closures are not pickled: the scheduler pickles, and keeps none after
    again = pickle.loads(pickle.dumps(sched))
    assert again._decode_times == {}


def test_runs_without_a_varying_form_same_results_as_per_turn() -> None:
    layout = ParallelDegrees(tp=8, spp=2, kvp=1)
    own = _OwnGroupTime.from_spec({"model": "llama3-8b", "gpu": "a100"}, layout=layout)
    assert own.group_time_varying([1, 0, 0, 1, 0, 1], 1, 2) is None
    runs = _simulator(own)
    got = runs.run(_trace())
    per_turn = _simulator(own, turn_runs=False).run(_trace())
    assert_same_results(got, per_turn)
    kept = runs.sched._decode_times
    assert kept and all(f.__name__ == "rebuilt" for f in kept.values())
    for nt, time_of in kept.items():
        row = _row(own, nt, 12_345)
        assert time_of(row[1], row[2]) == own.group_time(row)
    # and the roofline itself (its varying form) gives the very same results
    assert_same_results(got, _simulator().run(_trace()))
