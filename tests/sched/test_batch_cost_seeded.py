"""A scan turn's draft seeded with a known time, and its chunk's time noted.

``turn_run``'s scan turns seed a fresh draft with the lane's totals and the
time it already has for them (``BatchCost.seed_priced``) instead of
``seed([totals])`` pricing them again, and note the time its search found
for the first prompt's chunk (``note_tail``) so that ``add`` of that chunk
does not price it again. Both must leave the batch exactly as the old calls
did: the same totals, group times, time and probes, float for float. And
``chunk_works``' one-shard shortcut must give the works of the general
spelling.
"""

from __future__ import annotations

import pickle
import random

import pytest

from medha_sched.batch_cost import BatchCost, chunk_works
from medha_sched.config import ParallelDegrees
from medha_sched.cost import RooflineCostModel
from medha_sched.cost.registry import parse_cost_model_spec


def _model() -> RooflineCostModel:
    model = parse_cost_model_spec(
        "roofline:model=llama3-8b,gpu=a100", layout=ParallelDegrees(tp=8, spp=2)
    )
    assert isinstance(model, RooflineCostModel)
    return model


def _general_chunk_works(groups, start, num_tokens, group_limit):
    """``chunk_works`` as it was spelled before its one-shard shortcut."""
    tail = start // group_limit
    works = [(groups[i], num_tokens, group_limit, False) for i in range(tail)]
    works.append((groups[tail], num_tokens, start - tail * group_limit, True))
    return works


def test_chunk_works_shortcut_gives_the_general_works() -> None:
    rng = random.Random(3)
    for _ in range(5_000):
        limit = rng.choice([1, 7, 4096, 1 << 20])
        groups = tuple(rng.sample(range(8), rng.randint(1, 8)))
        start = rng.choice(
            [0, limit - 1, limit, rng.randrange(limit * len(groups)), rng.randrange(limit)]
        )
        start = min(start, limit * len(groups) - 1)
        n = rng.randint(1, 9000)
        got = chunk_works(groups, start, n, limit)
        want = _general_chunk_works(groups, start, n, limit)
        assert got == want
        assert [type(x) for w in got for x in w] == [type(x) for w in want for x in w]


def _state(cost: BatchCost):
    return (
        cost.time,
        [None if t is None else list(t) for t in cost._totals],
        list(cost._group_times),
        {k: (None if v[0] is None else list(v[0]), v[1]) for k, v in cost._probes.items()},
    )


def _lane_totals(rng: random.Random, model: RooflineCostModel) -> list[int] | None:
    if rng.random() < 0.2:
        return None
    feats = [model.features(1, rng.randint(1, 300_000), True) for _ in range(rng.randint(1, 60))]
    return [sum(col) for col in zip(*feats, strict=True)]


@pytest.mark.parametrize("priced", [True, False])
def test_seed_priced_and_note_tail_leave_the_batch_as_seed_and_add(priced: bool) -> None:
    model = _model()
    price = model.chunk_price() if priced else None
    search = model.chunk_price().search
    rng = random.Random(7 + priced)
    noted = 0
    for _ in range(2_000):
        totals = _lane_totals(rng, model)
        old = BatchCost(model, 1, price=price)
        new = BatchCost(model, 1, price=price)
        old.seed([None if totals is None else list(totals)])
        time = 0.0 if totals is None else model.group_time(totals)
        new.seed_priced(None if totals is None else list(totals), time)
        assert _state(new) == _state(old)
        start = rng.choice([0, rng.randint(0, 200_000), rng.randint(0, 4096)])
        target = rng.choice([0.05, 0.025, 0.1])
        n, t = search(8192, 32, new._totals[0], start, target, new.time, rng.randint(0, 9000))
        if n == 0:
            continue
        new.note_tail(0, n, start, t)
        assert bool(new._probes) == priced  # a batch without a price notes nothing
        work = chunk_works((0,), start, n, 1 << 20)
        old.add(work)
        new.add(work)
        assert _state(new) == _state(old)
        noted += 1
        # a second chunk after it, priced as before on both
        k = rng.randint(1, 2048)
        assert new.time_with_tail(0, k, 0) == old.time_with_tail(0, k, 0)
        old.add([(0, k, 0, True)])
        new.add([(0, k, 0, True)])
        assert _state(new) == _state(old)
    assert noted > 1_000


def test_a_seeded_batch_pickles() -> None:
    model = _model()
    cost = BatchCost(model, 1, price=None)
    cost.seed_priced([5, 10, 10, 5, 0, 5], model.group_time([5, 10, 10, 5, 0, 5]))
    again = pickle.loads(pickle.dumps(cost))
    assert _state(again) == _state(cost)


def test_add_takes_the_noted_time_and_sums_the_totals() -> None:
    """The noted time is what ``add`` keeps (it is not priced again): a time
    that is not the chunk's shows it, and the totals are summed as ever."""
    model = _model()
    cost = BatchCost(model, 1, price=model.chunk_price())
    totals = [5, 10, 10, 5, 0, 5]
    cost.seed_priced(list(totals), model.group_time(totals))
    cost.note_tail(0, 300, 700, 0.125)
    cost.add(chunk_works((0,), 700, 300, 1 << 20))
    assert cost.time == 0.125
    feats = model.features(300, 700, True)
    assert cost._totals[0] == [a + b for a, b in zip(totals, feats, strict=True)]
