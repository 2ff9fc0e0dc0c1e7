"""``KineticIndex``'s hot seats: an item renewed in place leaves the tree and
is matched against the tree's winner at every query, so renewing it again
costs no match (a prefill taking turn after turn).

Twin indexes, one with the seats and one without (``_seats = 0``, every
renewal repaired up the tree), go through the same random operations: every
answer (``peek``, ``iter_sorted``, ``count_ahead``, ``renew``'s acceptance)
must be the same, and the seated one with its seated items put back in
their leaves must hold the same tree, certificates and free lists.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.priority_index import KineticIndex
from tests.sched.test_index_renew import _state


class _Twins:
    def __init__(self) -> None:
        self.plain: KineticIndex[int] = KineticIndex()
        self.plain._seats = 0
        self.hot: KineticIndex[int] = KineticIndex()
        self.now = 0.0
        self.seq = 0
        self.live: list[int] = []
        self.hot_renewals = 0  # renewals of an item already seated
        self.evictions = 0  # seated items put back by a third one

    def both(self, name: str, *args, **kwargs):
        got = [getattr(t, name)(*args, **kwargs) for t in (self.plain, self.hot)]
        if name == "iter_sorted":
            got = [list(g) for g in got]
        assert got[0] == got[1], (name, args, kwargs, got)
        return got[0]

    def add(self, b: float, m: float) -> None:
        self.seq += 1
        self.both("add", self.seq, intercept=b, slope=m, tiebreak=(self.seq,))
        self.live.append(self.seq)

    def renew(self, item: int, b: float, m: float) -> None:
        self.seq += 1
        seated = self.hot._slot[item] in self.hot._hot
        full = len(self.hot._hot) == self.hot._seats
        if self.both("renew", item, intercept=b, slope=m, tiebreak=(self.seq,)):
            self.hot_renewals += seated
            self.evictions += not seated and full
        else:  # the plain path: remove then add (a new slot)
            for t in (self.plain, self.hot):
                t.remove(item)
                t.add(item, intercept=b, slope=m, tiebreak=(self.seq,))

    def remove(self, items: list[int]) -> None:
        for item in items:
            self.live.remove(item)
        self.both("remove_many", items)

    def query(self) -> None:
        first = self.both("peek", self.now)
        order = self.both("iter_sorted", self.now)
        # with seats as without, iter_sorted starts with peek's item (exactly:
        # the turns look up the first prompt with peek, the scan walks the order)
        assert first == (order[0] if order else None)
        if len(self.live) > 1:
            k = len(self.live) // 2
            self.both("count_ahead", self.live[:k], self.live[k:], self.now)

    def same_state(self) -> None:
        assert _state(self.plain) == _state(self.hot)
        self.hot.check()


def _line(rng: random.Random) -> tuple[float, float]:
    return rng.uniform(-50.0, 50.0), rng.choice([0.0, -1.0, -0.5, rng.uniform(-2.0, 0.0)])


@pytest.mark.parametrize("seed", range(4))
def test_seats_change_no_answer(seed: int) -> None:
    """Turns taken by the first one or two items (renewed again and again,
    their keys rising as a prefill's do), mixed with arrivals, removals
    (seated or not), updates, clock moves and capacity doublings."""
    rng = random.Random(seed)
    tw = _Twins()
    for step in range(3000):
        op = rng.random()
        if op < 0.15 or len(tw.live) < 3:
            tw.add(*_line(rng))
        elif op < 0.2:
            k = rng.choice([1, 1, 1, 2])
            tw.remove(rng.sample(tw.live, min(k, len(tw.live) - 1)))
        elif op < 0.3:
            tw.now += rng.uniform(0.0, 2.0)
            tw.query()
        elif op < 0.35:
            item = rng.choice(tw.live)
            b, m = _line(rng)
            tw.both("update", item, intercept=b, slope=m)
        else:
            # a turn: the first item at the clock (or another one) renewed with
            # its slope and a higher key
            item = tw.both("peek", tw.now) if rng.random() < 0.85 else rng.choice(tw.live)
            slot = tw.hot._slot[item]
            m = tw.hot._m[slot] if rng.random() < 0.9 else _line(rng)[1]
            b = tw.hot._b[slot] + rng.uniform(0.0, 3.0)
            tw.renew(item, b, m)
        if step % 50 == 0:
            tw.query()
        if step % 250 == 0:
            tw.same_state()
    tw.query()
    tw.same_state()
    assert tw.hot._cap >= 64  # doublings happened with items seated
    assert tw.hot_renewals > 500 and tw.evictions > 100  # both seat paths were taken


@settings(max_examples=120, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "first", "any", "remove", "tick", "update"]),
            st.floats(-20.0, 20.0, allow_nan=False).map(lambda x: round(x, 1)),
            st.sampled_from([0.0, -1.0, -0.5, -0.25, -2.0]),
            st.integers(0, 1_000),
        ),
        max_size=120,
    )
)
def test_seats_change_no_answer_any_sequence(ops: list[tuple[str, float, float, int]]) -> None:
    """Any operation sequence, keys on a coarse grid (exact ties between keys,
    tie-breaks deciding): same answers and, seats put back, the same tree."""
    tw = _Twins()
    for op, b, m, pick in ops:
        if op == "add" or not tw.live:
            tw.add(b, m)
        elif op == "first":
            item = tw.both("peek", tw.now)
            tw.renew(item, b, m)
        elif op == "any":
            tw.renew(tw.live[pick % len(tw.live)], b, m)
        elif op == "remove":
            tw.remove([tw.live[pick % len(tw.live)]])
        elif op == "tick":
            tw.now += (pick % 7) * 0.5
            tw.query()
        else:
            tw.both("update", tw.live[pick % len(tw.live)], intercept=b, slope=m)
    tw.query()
    tw.same_state()


def test_a_seated_item_renewed_again_replays_no_match() -> None:
    """The point of the seats: the second and later renewals of one item (and
    of two in alternation) play no match."""
    index: KineticIndex[int] = KineticIndex()
    for i in range(24):  # two pages: the renewals stay in theirs
        index.add(i, intercept=float(i), slope=-0.5 + i * 1e-3, tiebreak=(i,))
    assert index.renew(0, intercept=0.1, slope=-0.5, tiebreak=(100,))
    assert index.renew(1, intercept=0.2, slope=-0.499, tiebreak=(101,))
    before = index.stats.comparisons
    for k in range(10):
        assert index.peek(0.0) == k % 2
        m = -0.5 + (k % 2) * 1e-3
        assert index.renew(k % 2, intercept=0.1 * (k + 3), slope=m, tiebreak=(102 + k,))
    assert index.stats.comparisons == before
    assert index.peek(0.0) == 0 and list(index.iter_sorted(0.0))[:3] == [0, 1, 2]
    index.check()


@pytest.mark.parametrize("change", ["renew", "update", "remove"])
def test_changing_a_seated_item_stops_a_live_iteration(change: str) -> None:
    """A seated item changed (no match replayed) still invalidates an
    ``iter_sorted`` generator, as any other change does."""
    index: KineticIndex[int] = KineticIndex()
    for i in range(10):
        index.add(i, intercept=float(i), slope=0.0, tiebreak=(i,))
    assert index.renew(0, intercept=0.5, slope=0.0, tiebreak=(10,))
    assert 0 in [index._items[s] for s in index._hot]
    it = index.iter_sorted(0.0)
    assert next(it) == 0
    if change == "renew":
        assert index.renew(0, intercept=0.7, slope=0.0, tiebreak=(11,))
    elif change == "update":
        index.update(0, intercept=0.7, slope=0.0)
    else:
        index.remove(0)
    with pytest.raises(RuntimeError, match="modified while iter_sorted"):
        next(it)


def test_moving_a_seated_item_stops_a_live_iteration() -> None:
    """A seated item renewed to a slope laid out on another page moves slots
    (``_move``) and still invalidates an ``iter_sorted`` generator."""
    index: KineticIndex[int] = KineticIndex()
    for i in range(40):
        index.add(i, intercept=float(i), slope=-0.01 * i, tiebreak=(i,))
    slot = index._slot[39]
    assert index.renew(39, intercept=39.5, slope=-0.39, tiebreak=(40,))
    assert index._slot[39] == slot and slot in index._hot  # seated in place
    it = index.iter_sorted(0.0)
    assert next(it) == 0
    assert index.renew(39, intercept=0.5, slope=0.0, tiebreak=(41,))
    assert index._slot[39] != slot  # moved to its new slope's page, still seated
    with pytest.raises(RuntimeError, match="modified while iter_sorted"):
        next(it)
    index.check()


@pytest.mark.parametrize("seated_slope", [-1.0, -0.5])
def test_a_seat_and_the_tree_at_their_exact_crossing(seated_slope: float) -> None:
    """At the crossing time itself the smaller slope wins, seated or in the
    tree: lines 2 - t and 1 - t / 2 cross at t = 2 (key 0)."""
    tw = _Twins()
    lines = {-1.0: 2.0, -0.5: 1.0}
    other = -1.5 - seated_slope  # the other slope of the two
    tw.add(lines[other], other)  # item 1 in the tree
    tw.add(9.0, 0.0)  # item 2 (the first in the tree until t = 2 ... and after)
    tw.add(50.0, seated_slope)  # item 3, renewed onto its line and seated
    tw.renew(3, lines[seated_slope], seated_slope)
    assert tw.hot._hot == [tw.hot._slot[3]]
    for now in (1.5, 2.0):
        tw.now = now
        tw.query()
    assert tw.plain.peek(2.0) == tw.hot.peek(2.0) == 1 + 2 * (seated_slope == -1.0)
    tw.now = 2.5
    tw.query()


def test_advance_checks_its_time() -> None:
    """``advance`` (every query's first step) takes a finite real, as a float,
    and refuses a clock that goes back; the same time again changes nothing."""
    index: KineticIndex[int] = KineticIndex(1.0)
    index.add(0, intercept=0.0, slope=-1.0, tiebreak=(0,))
    index.add(1, intercept=0.5, slope=0.0, tiebreak=(1,))
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="time must be finite"):
            index.advance(bad)
    with pytest.raises(ValueError, match="time must be a real number"):
        index.advance("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="time went backwards"):
        index.advance(0.5)
    epoch = index._epoch
    index.advance(1)  # an int: 1.0, the clock already
    assert index._epoch == epoch and type(index.clock) is float
    index.advance(2)
    assert index.clock == 2.0 and type(index.clock) is float
    assert index.peek(2) == 0
    with pytest.raises(ValueError, match="time went backwards"):
        index.peek(1.5)


@pytest.mark.parametrize("seated", ["a", "c"])
def test_iter_sorted_starts_with_peek_at_a_near_tie(seated: str) -> None:
    """Two keys equal to the last bit at ``now`` whose match (crossing time)
    and key order disagree: the match gives ``c``, the heap's key order
    ``a``. With one of them seated, ``peek`` and the first item of
    ``iter_sorted`` are still the tree's answer, ``c`` (the turns take the
    first prompt by ``peek``, the scan by the order)."""
    now = 25.50690257394217
    lines = {
        "a": (1.3436424411240122, -0.8474337369372327),
        "c": (-0.7902425301194249, -0.763774618976614),
    }
    assert lines["a"][0] + lines["a"][1] * now == lines["c"][0] + lines["c"][1] * now
    tw = _Twins()
    for name in "ac":
        tw.add(*lines[name])  # items 1 (a) and 2 (c)
    item = 1 if seated == "a" else 2
    tw.renew(item, *lines[seated])
    assert tw.hot._hot == [tw.hot._slot[item]]
    tw.now = now
    tw.query()  # both: peek == first of iter_sorted, seated and not
    assert tw.hot.peek(now) == 2 and next(tw.hot.iter_sorted(now)) == 2
