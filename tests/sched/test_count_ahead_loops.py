"""``KineticIndex.count_ahead`` against its plain loops (the form it had before
its keys were read in one comprehension): the same count for any lines,
``ahead`` and ``behind`` sets, clock, and keys past the float range
(infinite: lines and clock are finite, so no key is NaN)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.priority_index import AHEAD_RTOL, KineticIndex

_INF = math.inf


def _loops(index: KineticIndex, ahead: list[int], behind: list[int], now: float) -> int:
    index.advance(now)
    now = index._clock
    slot_of, b, m = index._slot, index._b, index._m
    low, rivals = _INF, 0
    for item in behind:
        s = slot_of[item]
        k = b[s] + m[s] * now
        rivals += 1
        if k < low:
            low = k
    if not rivals:
        return len({item for item in ahead if item in slot_of})
    low -= AHEAD_RTOL * (index._hi_b + index._hi_m * abs(now))
    if not -_INF < low < _INF:
        return 0
    counted = set()
    for item in ahead:
        s = slot_of.get(item)
        if s is not None and b[s] + m[s] * now < low:
            counted.add(item)
    return len(counted)


_line = st.tuples(
    st.floats(-100.0, 100.0, allow_nan=False).map(lambda x: round(x, 1)),
    st.sampled_from([0.0, -1.0, -0.5, -2.0, 0.25]),
)


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(_line, min_size=1, max_size=30),
    extreme=st.sampled_from([None, (1e300, 0.0), (-1e300, 1e300), (0.0, -1e300)]),
    picks=st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=40),
    now=st.sampled_from([0.0, 1.5, 10.0, 1e10]),
)
def test_count_ahead_equals_its_loops(
    lines: list[tuple[float, float]],
    extreme: tuple[float, float] | None,
    picks: list[tuple[int, bool]],
    now: float,
) -> None:
    """``extreme``: one line of huge magnitude (an infinite key, or a margin
    that swamps every other key), or none (most examples)."""
    if extreme is not None:
        lines = [*lines, extreme]
    index: KineticIndex[int] = KineticIndex()
    for i, (b, m) in enumerate(lines):
        index.add(i, intercept=b, slope=m, tiebreak=(i,))
    ahead = [i for i, side in picks if side]  # some not in the index (>= len(lines))
    behind = list(dict.fromkeys(i for i, side in picks if not side and i < len(lines)))
    assert index.count_ahead(ahead, behind, now) == _loops(index, ahead, behind, now)


def test_the_counts_are_not_all_zero() -> None:
    """The comparison above means something: with ordinary lines most counts are positive."""
    index: KineticIndex[int] = KineticIndex()
    for i in range(20):
        index.add(i, intercept=float(i), slope=-0.5 * (i % 3), tiebreak=(i,))
    got = [index.count_ahead(range(k), range(k, 20), 1.0) for k in range(1, 20)]
    assert got == [_loops(index, list(range(k)), list(range(k, 20)), 1.0) for k in range(1, 20)]
    assert sum(g > 0 for g in got) > 10


def test_a_key_equal_to_the_bound_is_not_counted() -> None:
    """Every line 0: the margin is 0 and an equal key is not surely ahead."""
    index: KineticIndex[int] = KineticIndex()
    for i in range(3):
        index.add(i, intercept=0.0, slope=0.0, tiebreak=(i,))
    assert index.count_ahead([0, 1], [2], 1.0) == _loops(index, [0, 1], [2], 1.0) == 0
