"""The roofline's own chunk search against ``largest_chunk_priced``.

``RooflineCostModel.chunk_price()`` carries ``search``: the answer of
``largest_chunk_priced`` over that price (the largest grid candidate whose
time fits the target, and that time), with the price written out and the
candidate after one that fits proved over the target by the price's
convexity instead of priced. The price is monotone in the chunk in floats,
so every correct search returns the same chunk and the same float: these
tests ask for exactly that, bit for bit, on random bases, starts, targets
and hints, with targets placed at and around the candidates' own times
(where a bound too loose, or a time off by one unit in the last place,
would show), and check that the bound does spare probes.
"""

from __future__ import annotations

import inspect
import math
import random

import pytest

import medha_sched.cost.roofline as roofline
from medha_sched.chunking import chunk_search, largest_chunk_priced
from medha_sched.config import ParallelDegrees
from medha_sched.cost import RooflineCostModel
from medha_sched.cost.registry import parse_cost_model_spec

SPECS = [
    ("roofline:model=llama3-8b,gpu=a100", ParallelDegrees(tp=8, spp=2)),
    ("roofline:model=llama3-8b,gpu=a100", ParallelDegrees(tp=1, spp=1)),
    ("roofline:model=llama3-8b,gpu=a100", ParallelDegrees(tp=2, spp=4)),
]


def _model(i: int) -> RooflineCostModel:
    spec, layout = SPECS[i]
    model = parse_cost_model_spec(spec, layout=layout)
    assert isinstance(model, RooflineCostModel)
    return model


def _base(rng: random.Random, model: RooflineCostModel) -> list | None:
    """None, or a lane's decodes summed as DecodeLanes.totals does (ints), or floats."""
    kind = rng.random()
    if kind < 0.2:
        return None
    feats = [model.features(1, rng.randint(1, 400_000), True) for _ in range(rng.randint(1, 80))]
    if kind < 0.3:  # a chunk beside them (a draft's totals), a non-tail share too
        feats.append(model.features(rng.randint(1, 4096), rng.randint(0, 200_000), True))
        feats.append(model.features(rng.randint(1, 512), 4096, False))
    base = [sum(col) for col in zip(*feats, strict=True)]
    if kind > 0.9:
        base = [float(x) for x in base]
    return base


def _case(rng: random.Random, model: RooflineCostModel, price) -> tuple:
    grid = rng.choice([1, 16, 32, 64, 100])
    limit = rng.choice([1, grid, rng.randint(1, 9000), 8192, rng.randint(1, 300)])
    base = _base(rng, model)
    start = rng.choice([0, rng.randint(0, 1 << 20), rng.randint(0, 4096)])
    base_time = 0.0 if base is None else model.group_time(base)
    hint = rng.choice([0, 0, rng.randint(1, 9000), grid, limit, limit + grid])
    kind = rng.random()
    if kind < 0.5:  # the target right at a candidate's time, or one ulp either side
        n = min(rng.randint(1, -(-limit // grid)) * grid, limit)
        target = price(base, start, n)
        target = rng.choice([target, math.nextafter(target, 0.0), math.nextafter(target, 1.0)])
    else:
        target = rng.choice([0.05, 0.025, 0.01, 0.2, base_time, base_time * 1.01, 1e-6])
    return limit, grid, base, start, target, base_time, hint


@pytest.mark.parametrize("which", range(len(SPECS)))
def test_search_answers_as_largest_chunk_priced(which: int) -> None:
    model = _model(which)
    price = model.chunk_price()
    search = price.search
    rng = random.Random(which)
    nonzero = 0
    for _ in range(6_000):
        args = _case(rng, model, price)
        limit, grid, base, start, target, base_time, hint = args
        want = largest_chunk_priced(limit, grid, price, base, start, target, base_time, hint)
        got = search(*args)
        assert got == want, args
        assert type(got[1]) is float and math.copysign(1.0, got[1]) == 1.0
        nonzero += want[0] > 0
        # the brute answer: the largest candidate that fits
        if limit <= 2_000 and grid >= 16:
            fits = [
                c
                for c in {min(i * grid, limit) for i in range(1, -(-limit // grid) + 1)}
                if price(base, start, c) <= target
            ]
            assert got[0] == max(fits, default=0)
    assert nonzero > 1_500


def _probing_search(model: RooflineCostModel, price, counter: list[int]):
    """``_chunk_search`` with its probes counted (its source, one line added)."""
    src = inspect.getsource(roofline._chunk_search)
    marker = "            if t <= target:\n"
    assert src.count(marker) == 1
    src = src.replace(marker, "            COUNT[0] += 1\n" + marker)
    space = dict(vars(roofline), COUNT=counter)
    exec(compile(src, roofline.__file__, "exec"), space)
    return space["_chunk_search"](price, model._layer, model._outer)


def test_the_bound_spares_probes_and_written_out_price_is_price() -> None:
    model = _model(0)
    price = model.chunk_price()
    counted = [0]
    search = _probing_search(model, price, counted)
    rng = random.Random(5)
    old = new = 0
    for _ in range(3_000):
        limit, grid, base, start, target, base_time, _ = _case(rng, model, price)
        # the hint a turn most often has: the chunk the search finds
        hint, _ = largest_chunk_priced(limit, grid, price, base, start, target, base_time, 0)
        calls = [0]

        def counting(b, s, n, _calls=calls):
            _calls[0] += 1
            return price(b, s, n)

        args = (limit, grid, base, start, target, base_time, hint)
        want = largest_chunk_priced(limit, grid, counting, *args[2:])
        before = counted[0]
        assert search(*args) == want
        if 0 < want[0] < limit:  # (none to spare where the hint is the limit or none fits)
            old += calls[0]
            new += counted[0] - before
    assert new < 0.8 * old  # probes the bound spared


def test_a_negative_total_goes_to_largest_chunk_priced_and_a_bad_grid_is_refused() -> None:
    model = _model(0)
    price = model.chunk_price()
    base = [-5, 10, 10, 1, 0, 1]
    args = (4096, 32, base, 100, 0.05, 0.0, 512)
    assert price.search(*args) == largest_chunk_priced(4096, 32, price, *args[2:])
    with pytest.raises(ValueError, match="grid"):
        price.search(100, 0, None, 0, 0.05, 0.0, 0)
    assert price.search(0, 32, None, 0, 0.05, 0.0, 0) == (0, 0.0)


def test_chunk_search_falls_back_for_a_price_without_search() -> None:
    def price(base, start, n):
        return 0.001 * n + start * 1e-9

    search = chunk_search(price)
    for hint in (0, 64, 5000):
        assert search(4096, 32, None, 7, 1.0, 0.0, hint) == largest_chunk_priced(
            4096, 32, price, None, 7, 1.0, 0.0, hint
        )
    model = _model(0)
    assert chunk_search(model.chunk_price()) is model.chunk_price().search


@pytest.mark.parametrize("memo_max", [1, 3])
def test_the_memo_of_the_tail_token_terms_answers_as_priced(monkeypatch, memo_max) -> None:
    """The search keeps the terms that move with the tail tokens alone by their
    count (``q``, an int or a float of the same value): cleared when full, and
    whatever it holds, the answers are ``largest_chunk_priced``'s."""
    monkeypatch.setattr(roofline, "_BY_Q_MAX", memo_max)
    model = _model(0)
    price = model.chunk_price()
    rng = random.Random(17 + memo_max)
    for _ in range(2_000):
        args = _case(rng, model, price)
        limit, grid, base, start, target, base_time, hint = args
        want = largest_chunk_priced(limit, grid, price, base, start, target, base_time, hint)
        assert price.search(*args) == want, args
