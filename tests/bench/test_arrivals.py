"""Send times: Poisson and gamma arrivals at a rate, all at once, or a trace's own times."""

from __future__ import annotations

import math

import numpy as np
import pytest

from medha_runtime.bench.arrivals import arrival_offsets, schedule


def gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


def test_poisson_mean_rate_within_tolerance() -> None:
    offsets = arrival_offsets(4000, rate=10.0, seed=3)
    assert offsets[0] == 0.0
    assert (gaps(offsets) >= 0).all()
    rate = 1.0 / gaps(offsets).mean()
    assert rate == pytest.approx(10.0, rel=0.05)
    cv = gaps(offsets).std() / gaps(offsets).mean()
    assert cv == pytest.approx(1.0, rel=0.1)  # exponential gaps


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(burstiness: float) -> None:
    g = gaps(arrival_offsets(4000, rate=5.0, burstiness=burstiness, seed=1))
    assert 1.0 / g.mean() == pytest.approx(5.0, rel=0.1)  # the rate does not change
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)


def test_burstier_means_larger_variation() -> None:
    cvs = []
    for b in (0.2, 1.0, 5.0):
        g = gaps(arrival_offsets(2000, rate=5.0, burstiness=b, seed=0))
        cvs.append(g.std() / g.mean())
    assert cvs[0] > cvs[1] > cvs[2]


def test_seeded_and_infinite_rate() -> None:
    assert arrival_offsets(50, rate=2.0, seed=7) == arrival_offsets(50, rate=2.0, seed=7)
    assert arrival_offsets(50, rate=2.0, seed=7) != arrival_offsets(50, rate=2.0, seed=8)
    assert arrival_offsets(5, rate=math.inf) == [0.0] * 5
    assert arrival_offsets(0, rate=1.0) == []


def test_schedule_uses_trace_times_unless_a_rate_is_given() -> None:
    own = [0.5, 1.0, 4.0]
    assert schedule(own, rate=None) == own
    drawn = schedule(own, rate=100.0, seed=0)
    assert drawn != own and drawn[0] == 0.0 and len(drawn) == 3
    assert schedule([None, None], rate=None) == [0.0, 0.0]  # generated data: all at once


@pytest.mark.parametrize(
    ("kw", "word"), [({"rate": 0.0}, "rate"), ({"rate": 1.0, "burstiness": -1.0}, "burstiness")]
)
def test_bad_arguments_are_named(kw: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        arrival_offsets(3, **kw)
