"""A lane cycle's turns: the two-lane, two-stage loop (``two_lane_turns``, a
copy written out for speed) against the general one (``any_turns``), float
for float, on random plans with many ties (times on a coarse grid)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.sim.cycles import any_turns, cycle_turns, two_lane_turns

_GRID = st.integers(0, 40).map(lambda i: i * 0.25)
_TIME = st.one_of(st.integers(1, 12).map(lambda i: i * 0.5), st.floats(0.01, 3.0))


@settings(max_examples=500, deadline=None)
@given(
    t0=st.lists(_TIME, max_size=30),
    t1=st.lists(_TIME, max_size=30),
    ready=st.tuples(_GRID, _GRID),
    free=st.tuples(_GRID, _GRID),
    horizon=st.one_of(st.just(float("inf")), st.integers(0, 200).map(lambda i: i * 0.25)),
)
def test_two_lanes_as_any(t0, t1, ready, free, horizon) -> None:
    args = ([t0, t1], list(ready), list(free), horizon)
    want_ready, want_free = list(ready), list(free)
    want = any_turns(args[0], want_ready, want_free, horizon)
    got_ready, got_free = list(ready), list(free)
    got = two_lane_turns(args[0], got_ready, got_free, horizon)
    assert got == want
    assert (got_ready, got_free) == (want_ready, want_free)
    assert cycle_turns(*args) == want  # the dispatch takes the copy


def test_three_lanes_go_the_general_way() -> None:
    times = [[1.0, 1.0], [1.0], [1.0, 1.0]]
    got = cycle_turns(times, [0.0, 0.5, 0.75], [0.0, 0.0], float("inf"))
    assert got == any_turns(times, [0.0, 0.5, 0.75], [0.0, 0.0], float("inf"))
