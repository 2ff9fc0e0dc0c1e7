"""KineticIndex lays its items out again at the same capacity after many adds.

A queue filled at once (the scheduler benchmark's 1,000 waiting prompts) was
laid out by slope at its last doubling (512 items); the 488 added after sat
in order of arrival inside their pages and made the certificates fail about
twice as often in the first steps. Since 2026-11-27 a burst of adds (no
clock move between them) lays the items out again once it reaches one in
``_RELAY_SHARE`` of the items the latest layout placed (``_RELAY_MIN`` or
more). The layout changes where the leaves lie,
not the answers: these tests compare every answer with an index that never
lays out again (the constants patched) and with brute force.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import islice

import pytest

from medha_sched import priority_index
from medha_sched.priority_index import KineticIndex


def _lars_lines(n: int, seed: int) -> list[tuple[float, float, tuple]]:
    """Lines of a queue filled at once: arrivals within 1 s, the same
    relative slack, work 5 ms to 10 s (test_priority_index's)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        work = rng.uniform(2.0, 10.0) if rng.random() < 0.05 else rng.uniform(0.005, 0.4)
        arrival = -rng.random()
        out.append(((arrival + 2.0 * work) / work, -1.0 / work, (arrival, i)))
    return out


def _filled(lines: list[tuple[float, float, tuple]]) -> KineticIndex[int]:
    index: KineticIndex[int] = KineticIndex()
    for i, (b, m, tb) in enumerate(lines):
        index.add(i, intercept=b, slope=m, tiebreak=tb)
    return index


@pytest.fixture
def no_relayout(monkeypatch: pytest.MonkeyPatch):
    """Build an index that never lays out again at its capacity (the old path)."""

    def build(lines: list[tuple[float, float, tuple]]) -> KineticIndex[int]:
        with monkeypatch.context() as m:
            m.setattr(priority_index, "_RELAY_MIN", float("inf"))
            return _filled(lines)

    return build


def test_a_queue_filled_at_once_is_laid_out_again(no_relayout) -> None:
    """1,000 lines added at once: layouts at 320, 400 and 500 items (after the
    doubling at 256), 640, 800 and 1,000 (after the doubling at 512); the
    same order as without them at every step, and fewer failures."""
    lines = _lars_lines(1000, seed=3)
    new, old = _filled(lines), no_relayout(lines)
    assert (new.stats.rebuilds, new.stats.relayouts) == (10, 6)
    assert (old.stats.rebuilds, old.stats.relayouts) == (10, 0)
    assert new._relay_in == 250  # 1,000 // 4 more adds in this burst lay out again
    fails = {"new": 0, "old": 0}
    for step in range(1, 31):
        t = 0.05 * step
        for name, index in (("new", new), ("old", old)):
            before = index.stats.events
            index.advance(t)
            fails[name] += index.stats.events - before
        assert list(islice(new.iter_sorted(t), 50)) == list(islice(old.iter_sorted(t), 50))
        assert new.peek(t) == old.peek(t)
    new.check()
    assert list(new.iter_sorted(1.5)) == list(old.iter_sorted(1.5))
    assert fails["new"] < fails["old"], fails  # 51 against 62 (2026-11-27)


def test_a_small_index_only_doubles() -> None:
    """Under ``_RELAY_MIN`` items at the latest layout, adds only double: 256
    items (the latest doubling placed 128) are never laid out again; the
    doubling at the 257th places 256, and the 320th add lays out again."""
    index = _filled(_lars_lines(320, seed=5))
    assert (index.stats.rebuilds, index.stats.relayouts) == (9, 1)
    index = _filled(_lars_lines(319, seed=5))
    assert (index.stats.rebuilds, index.stats.relayouts) == (9, 0)
    index = _filled(_lars_lines(256, seed=5))
    for i in range(256, 256 + 3 * 256):  # churn: removals and adds, no doubling
        index.remove(i - 256)
        index.add(i, intercept=float(i), slope=-1.0, tiebreak=(i,))
    assert (index.stats.rebuilds, index.stats.relayouts) == (8, 0)


def test_random_operations_match_an_index_that_never_lays_out_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adds, removals, renewals (hot seats), updates and clock moves on two
    indexes, one laying out again once a burst of adds reaches one in 64 of
    the 8 or more items its latest layout placed (every add of a burst under
    64 items): the same answers throughout, and ``check()`` holds."""
    rng = random.Random(17)
    monkeypatch.setattr(priority_index, "_RELAY_SHARE", 64)
    new: KineticIndex[int] = KineticIndex()
    old: KineticIndex[int] = KineticIndex()
    live: list[int] = []
    t, nxt = 0.0, 0

    def each() -> Iterator[KineticIndex[int]]:
        """Both indexes, the constant set for each just before its call (a
        layout reads it): the old one never lays out again at its capacity."""
        for index in (new, old):
            monkeypatch.setattr(priority_index, "_RELAY_MIN", 8 if index is new else _NEVER)
            yield index

    for _ in range(3000):
        op = rng.random()
        if op < 0.45 or len(live) < 4:
            b, m = rng.uniform(-5.0, 5.0), -1.0 / rng.uniform(0.01, 10.0)
            for index in each():
                index.add(nxt, intercept=b, slope=m, tiebreak=(nxt,))
            live.append(nxt)
            nxt += 1
        elif op < 0.65:
            gone = live.pop(rng.randrange(len(live)))
            for index in each():
                index.remove(gone)
        elif op < 0.8:
            item = rng.choice(live)
            b, m = rng.uniform(-5.0, 5.0), -1.0 / rng.uniform(0.01, 10.0)
            for index in each():
                index.renew(item, intercept=b, slope=m, tiebreak=(nxt,))
            nxt += 1
        elif op < 0.97:
            item = rng.choice(live)
            b, m = rng.uniform(-5.0, 5.0), -1.0 / rng.uniform(0.01, 10.0)
            for index in each():
                index.update(item, intercept=b, slope=m)
        else:  # the clock moves: a new burst
            t += rng.uniform(0.0, 0.3)
            assert new.peek(t) == old.peek(t)
            assert list(new.iter_sorted(t)) == list(old.iter_sorted(t))
    assert new.stats.relayouts > 10 and old.stats.relayouts == 0
    new.check()
    old.check()
    assert list(new.iter_sorted(t + 1.0)) == list(old.iter_sorted(t + 1.0))


_NEVER = float("inf")


def _settled_by_calls(index: KineticIndex[int]) -> tuple:
    """The tree ``_settle`` called for every node, the deepest first, builds on
    ``index``'s leaves (versions 0, heap empty, as a layout starts)."""
    cap = index._cap
    index._win[1:cap] = [-1] * (cap - 1)
    index._ver, index._cert, index._events = [0] * cap, [float("inf")] * cap, []
    before = index.stats.comparisons
    for node in range(cap - 1, 0, -1):
        index._settle(node)
    return (index._win, index._ver, index._cert, index._events, index.stats.comparisons - before)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_settle_all_is_settle_of_every_node(seed: int) -> None:
    """The layout's written-out loop against ``_settle`` per node: lines of
    equal and different slopes, crossings before and after the clock, empty
    leaves, and a crossing past the float range."""
    rng = random.Random(seed)
    index: KineticIndex[int] = KineticIndex(start=rng.uniform(0.0, 2.0))
    for i in range(300):
        slope = rng.choice([0.0, -1.0, -1e-300, rng.uniform(-3.0, 0.0)])
        intercept = rng.choice([1e300, rng.uniform(-5.0, 5.0), 0.5])
        index.add(i, intercept=intercept, slope=slope, tiebreak=(rng.randrange(5), i))
    for i in rng.sample(range(300), 60):  # empty leaves
        index.remove(i)
    index._unseat()
    index._lay_out(index._cap)  # the written-out loop
    before = index.stats.comparisons
    index._lay_out(index._cap)  # once more: the same leaves, the counts of one layout
    got = (
        list(index._win),
        list(index._ver),
        list(index._cert),
        list(index._events),
        index.stats.comparisons - before,
    )
    assert any(c == float("inf") for c in index._cert[1 : index._cap])
    assert index._events  # some certificates pending
    assert got == _settled_by_calls(index)
    index.check()


def test_renew_is_the_pair_across_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``renew`` against ``remove`` then ``add`` with layouts in the bursts
    (one in 64 of the 8 or more items laid out): the same slots, tree and
    free lists after every call, where the pair's add lays out too."""
    from tests.sched.test_index_renew import _state

    monkeypatch.setattr(priority_index, "_RELAY_MIN", 8)
    monkeypatch.setattr(priority_index, "_RELAY_SHARE", 64)
    rng = random.Random(5)
    pair: KineticIndex[int] = KineticIndex()
    fused: KineticIndex[int] = KineticIndex()
    live: list[int] = []
    t, pairs = 0.0, 0
    for nxt in range(1500):
        op = rng.random()
        b, m = rng.uniform(-5.0, 5.0), -1.0 / rng.uniform(0.01, 10.0)
        if op < 0.4 or len(live) < 4:
            for index in (pair, fused):
                index.add(nxt, intercept=b, slope=m, tiebreak=(nxt,))
            live.append(nxt)
        elif op < 0.5:
            gone = live.pop(rng.randrange(len(live)))
            for index in (pair, fused):
                index.remove(gone)
        elif op < 0.97:
            item = rng.choice(live)
            if rng.random() < 0.7:  # mostly the slope it had
                m = pair._m[pair._slot[item]]
            laid = fused.stats.relayouts
            if fused.renew(item, intercept=b, slope=m, tiebreak=(nxt,), move=rng.random() < 0.8):
                pair.remove(item)
                pair.add(item, intercept=b, slope=m, tiebreak=(nxt,))
                pairs += fused.stats.relayouts > laid
            else:
                for index in (pair, fused):
                    index.remove(item)
                    index.add(item, intercept=b, slope=m, tiebreak=(nxt,))
        else:
            t += rng.uniform(0.0, 0.3)
            assert pair.peek(t) == fused.peek(t)
        assert _state(pair) == _state(fused)
    assert pairs > 5 and fused.stats.relayouts == pair.stats.relayouts
    fused.check()
