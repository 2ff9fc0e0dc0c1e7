"""Tests for ``largest_fitting_chunk``: the binary search over the token grid.

The search must return exactly what a brute-force scan returns for any
monotone predicate, never a chunk that does not fit (the reference
implementation overshot to 1.83*T by picking the candidate closest to T), and
use only a logarithmic number of predicate calls.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched import BatchWork, largest_fitting_chunk
from medha_sched.chunking import _GUESSES, largest_chunk_within

from .models import poly_models

SETTINGS = settings(max_examples=300, deadline=None)


def candidates(limit: int, grid: int) -> list[int]:
    """``grid, 2*grid, ...`` strictly below ``limit``, then ``limit`` itself."""
    return [*range(grid, limit, grid), limit] if limit > 0 else []


def brute_force(limit: int, grid: int, fits) -> int:
    return max((c for c in candidates(limit, grid) if fits(c)), default=0)


def max_calls(limit: int, grid: int) -> int:
    return math.ceil(math.log2(math.ceil(limit / grid))) + 2


class Recorder:
    """Wraps a predicate and records every argument it is called with."""

    def __init__(self, fits) -> None:
        self.fits = fits
        self.calls: list[int] = []

    def __call__(self, n: int) -> bool:
        self.calls.append(n)
        return self.fits(n)


def check_search(limit: int, grid: int, fits) -> int:
    rec = Recorder(fits)
    got = largest_fitting_chunk(limit, grid, rec)
    assert got == brute_force(limit, grid, fits), (limit, grid, got)
    if got:
        assert fits(got), f"returned {got}, which does not fit (overshoot)"
        assert got in candidates(limit, grid)
        if got < limit:
            assert got % grid == 0, f"non-final chunk {got} is off the grid {grid}"
            bigger = min(got + grid, limit)
            assert not fits(bigger), f"{got} is not maximal: {bigger} fits"
    allowed = set(candidates(limit, grid))
    assert all(n in allowed for n in rec.calls), f"probed off-grid sizes {rec.calls}"
    if limit > 0:
        assert len(rec.calls) <= max_calls(limit, grid), (limit, grid, len(rec.calls))
    return got


@SETTINGS
@given(
    limit=st.integers(0, 5000),
    grid=st.integers(1, 64),
    k=st.one_of(st.integers(-5, 5200), st.just(0)),
)
def test_threshold_predicate_matches_brute_force(limit: int, grid: int, k: int) -> None:
    got = check_search(limit, grid, lambda n: n <= k)
    assert got <= max(k, 0)


@SETTINGS
@given(
    model=poly_models(),
    limit=st.integers(0, 5000),
    grid=st.integers(1, 64),
    kv=st.integers(0, 50_000),
    target=st.floats(1e-4, 0.2),
)
def test_cost_model_predicate_matches_brute_force(model, limit, grid, kv, target) -> None:
    def fits(n: int) -> bool:
        return model.predict(BatchWork.single_group((n, kv))) <= target

    got = check_search(limit, grid, fits)
    if got:
        assert model.predict(BatchWork.single_group((got, kv))) <= target


@pytest.mark.parametrize("limit", [0, -1, -64, -10_000])
def test_non_positive_limit_gives_zero_without_probing(limit: int) -> None:
    rec = Recorder(lambda n: True)
    assert largest_fitting_chunk(limit, 32, rec) == 0
    assert rec.calls == []


def test_nothing_fits_gives_zero_only_after_seeing_the_smallest_fail() -> None:
    rec = Recorder(lambda n: False)
    assert largest_fitting_chunk(4096, 32, rec) == 0
    assert 32 in rec.calls, "0 may only be returned once the smallest chunk was seen to fail"
    assert len(rec.calls) <= max_calls(4096, 32)


def test_everything_fits_gives_the_limit() -> None:
    assert largest_fitting_chunk(1000, 32, lambda n: True) == 1000
    assert largest_fitting_chunk(1024, 32, lambda n: True) == 1024
    assert largest_fitting_chunk(5, 32, lambda n: True) == 5  # final piece below the grid


def test_final_piece_off_grid_only_when_it_is_the_limit() -> None:
    # 1000 = 31*32 + 8: the limit itself fits but 992 is the largest grid chunk below it.
    assert largest_fitting_chunk(1000, 32, lambda n: n <= 999) == 992
    assert largest_fitting_chunk(1000, 32, lambda n: n <= 1000) == 1000


def test_linear_cost_never_overshoots_target() -> None:
    # The reference search moved lo/hi to mid and picked the candidate closest
    # to T, which could lie above T (1.83*T with linear costs). Here the exact
    # answer is known: 1e-3 + 1e-5*n <= 0.05  <=>  n <= 4900  ->  4896 on a 32 grid.
    target = 0.05

    def fits(n: int) -> bool:
        return 1e-3 + 1e-5 * n <= target

    got = largest_fitting_chunk(8192, 32, fits)
    assert got == 4896
    assert 1e-3 + 1e-5 * got <= target
    assert 1e-3 + 1e-5 * (got + 32) > target


@pytest.mark.parametrize(
    "limit,grid", [(1, 1), (2, 1), (5000, 1), (4096, 64), (4097, 64), (64, 64)]
)
def test_call_count_is_logarithmic(limit: int, grid: int) -> None:
    worst = 0
    for k in range(0, limit + 2, max(1, limit // 97)):
        rec = Recorder(lambda n, k=k: n <= k)
        largest_fitting_chunk(limit, grid, rec)
        worst = max(worst, len(rec.calls))
    assert worst <= max_calls(limit, grid)


# ------------------------------------------------------ largest_chunk_within
def max_calls_within(limit: int, grid: int) -> int:
    count = math.ceil(limit / grid)
    return math.ceil(math.log2(count + 1)) + _GUESSES + 1


def check_within(limit: int, grid: int, time_of, target: float, base: float, hint: int) -> int:
    """``largest_chunk_within`` equals the brute-force answer and stays on the grid."""
    calls: list[int] = []

    def rec(n: int) -> float:
        calls.append(n)
        return time_of(n)

    got = largest_chunk_within(limit, grid, rec, target, base=base, hint=hint)
    assert got == brute_force(limit, grid, lambda n: time_of(n) <= target), (limit, grid, got)
    allowed = set(candidates(limit, grid))
    assert all(n in allowed for n in calls), f"probed off-grid sizes {calls}"
    assert len(calls) <= max(max_calls_within(limit, grid), 0), (limit, grid, calls)
    if got:
        assert got in calls, "returned a chunk it never saw fit"
    return len(calls)


@SETTINGS
@given(
    limit=st.integers(0, 5000),
    grid=st.integers(1, 64),
    k=st.integers(-5, 5200),
    base=st.floats(-10.0, 6000.0),
    hint=st.integers(0, 6000),
)
def test_within_threshold_matches_brute_force(limit, grid, k, base, hint) -> None:
    # time n against target k: the answer is the largest candidate <= k
    check_within(limit, grid, float, float(k), base, hint)


@SETTINGS
@given(
    model=poly_models(),
    limit=st.integers(0, 5000),
    grid=st.integers(1, 64),
    kv=st.integers(0, 50_000),
    target=st.floats(1e-4, 0.2),
    hint=st.integers(0, 6000),
)
def test_within_cost_model_matches_brute_force(model, limit, grid, kv, target, hint) -> None:
    def time_of(n: int) -> float:
        return model.predict(BatchWork.single_group((n, kv)))

    check_within(limit, grid, time_of, target, 0.0, hint)


@SETTINGS
@given(
    limit=st.integers(1, 5000),
    grid=st.integers(1, 64),
    steps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=40),
    target=st.floats(0.0, 100.0),
    hint=st.integers(0, 6000),
)
def test_within_any_non_decreasing_time(limit, grid, steps, target, hint) -> None:
    # a staircase with flat parts and jumps: the line through two probes is
    # often flat or far off, and the answer must still be exact
    def time_of(n: int) -> float:
        return sum(steps[: n * len(steps) // (limit + 1) + 1])

    check_within(limit, grid, time_of, target, 0.0, hint)


def test_within_near_linear_time_takes_few_probes() -> None:
    # about the roofline model's shape: a fixed part plus a nearly linear one
    def time_of(n: int) -> float:
        return 0.012 + 1.7e-5 * n + 1e-10 * n * n

    probes = []
    for target in (0.02, 0.03, 0.05, 0.08):
        for hint in (0, 32, 640, 2048):
            probes.append(check_within(4096, 32, time_of, target, 0.012, hint))
    assert max(probes) <= 4, probes
    # the bisecting search from a hint gallops: more probes for a far hint
    rec = Recorder(lambda n: time_of(n) <= 0.05)
    largest_fitting_chunk(4096, 32, rec, hint=32)
    assert len(rec.calls) > 4


def test_within_non_positive_limit_gives_zero_without_probing() -> None:
    calls: list[int] = []
    assert largest_chunk_within(0, 32, lambda n: calls.append(n) or 0.0, 1.0) == 0
    assert largest_chunk_within(-5, 32, lambda n: calls.append(n) or 0.0, 1.0) == 0
    assert calls == []


@pytest.mark.parametrize("base", [0.0, math.inf, math.nan])
def test_within_infinite_times_and_odd_base(base: float) -> None:
    # times that overflow past some size: the interpolated guess is not a
    # number, and the search must still end with the exact answer
    def time_of(n: int) -> float:
        return math.inf if n > 700 else 1e-3 * n

    for hint in (0, 32, 2048):
        for target in (0.1, 0.5, 0.7, math.inf):
            check_within(4096, 32, time_of, target, base, hint)


@pytest.mark.parametrize("grid", [0, -16])
def test_a_grid_below_one_is_refused_by_both_searches(grid: int) -> None:
    with pytest.raises(ValueError, match=f"grid must be >= 1, got {grid}"):
        largest_fitting_chunk(100, grid, lambda n: True)
    with pytest.raises(ValueError, match=f"grid must be >= 1, got {grid}"):
        largest_chunk_within(100, grid, float, 50.0)
