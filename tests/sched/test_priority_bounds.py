"""``KineticIndex``'s ``count_ahead`` margin bound follows the live lines.

The bound (``_hi_b`` / ``_hi_m``: the largest ``|intercept|`` / ``|slope|``)
must cover every line in the index after every operation, or ``count_ahead``
could count an item the walk yields late; and it must come down once an
extreme line has left (at the next event compaction or rebuild, or at once
when the index empties), or one such line switches the scan's early stop off
for the rest of a run.
"""

from __future__ import annotations

import random

import pytest

from medha_sched.priority_index import KineticIndex


def _live_max(index: KineticIndex) -> tuple[float, float]:
    """The largest ``|intercept|`` and ``|slope|`` of the lines in ``index``, by brute force."""
    slots = list(index._slot.values())
    return (
        max((abs(index._b[s]) for s in slots), default=0.0),
        max((abs(index._m[s]) for s in slots), default=0.0),
    )


@pytest.mark.parametrize("seed", range(6))
def test_bound_covers_every_live_line_after_every_operation(seed) -> None:
    rng = random.Random(seed)
    index: KineticIndex[int] = KineticIndex()
    now, next_id = 0.0, 0
    refreshed = 0
    for seq in range(1500):
        op = rng.random()
        extreme = rng.random() < 0.03
        scale = 1e9 if extreme else 1e3
        b, m = rng.uniform(-scale, scale), rng.choice([-1.0, 0.0, 1.0]) * rng.uniform(0, scale)
        items = list(index._slot)
        if op < 0.4 or not items:
            index.add(next_id, intercept=b, slope=m, tiebreak=(seq,))
            next_id += 1
        elif op < 0.55:
            index.update(rng.choice(items), intercept=b, slope=m)
        elif op < 0.7:
            index.renew(rng.choice(items), intercept=b, slope=m, tiebreak=(seq,))
        elif op < 0.85:
            index.remove_many(rng.sample(items, min(len(items), rng.randint(1, 3))))
        else:
            now += rng.uniform(0.0, 5.0)
            index.advance(now)
        hi_b, hi_m = _live_max(index)
        assert index._hi_b >= hi_b and index._hi_m >= hi_m
        refreshed += index._hi_b == hi_b and index._hi_m == hi_m
        index.check()  # checks the same cover, with the tree
    assert refreshed > 0


def test_bound_shrinks_after_the_extreme_line_leaves() -> None:
    index: KineticIndex[int] = KineticIndex()
    for i in range(40):  # nearly parallel lines, keys 1.0 apart
        index.add(i, intercept=float(i), slope=-1.0 - 1e-3 * (i % 7), tiebreak=(i,))
    index.add(-1, intercept=1e12, slope=-5e6, tiebreak=(-1,))  # far behind, extreme
    index.advance(1.0)
    assert index._hi_b == 1e12 and index._hi_m == 5e6
    # margin 1e-10 * (1e12 + 5e6) = 100 > 39: nothing is told
    assert index.count_ahead(range(5), [39], 1.0) == 0
    index.remove(-1)
    # churn that changes no line of the lines left: each update moves one item
    # back and forth, pushing certificates until the heap compacts
    events, compactions = len(index._events), 0
    for step in range(20 * index._cap):
        i = step % 40
        b, m = float(i) + (0.5 if step % 80 < 40 else 0.0), -1.0 - 1e-3 * (i % 7)
        index.update(i, intercept=b, slope=m)
        compactions += len(index._events) < events
        events = len(index._events)
    assert compactions > 0
    # down to lines stored since the last compaction: at most 39.5 and 1.006
    want_b, want_m = _live_max(index)
    assert want_b <= index._hi_b <= 39.5 and want_m <= index._hi_m <= 1.006
    assert index.count_ahead(range(5), [39], 1.0) == 5  # the early stop is back
    index.check()


def test_bound_is_zero_when_the_index_empties_and_rebuild_refreshes() -> None:
    index: KineticIndex[str] = KineticIndex()
    index.add("x", intercept=-3e8, slope=2e5, tiebreak=())
    index.add("y", intercept=1.0, slope=0.5, tiebreak=())
    index.remove_many(["x", "y"])
    assert (index._hi_b, index._hi_m) == (0.0, 0.0)
    index.add("z", intercept=-7e9, slope=4.0, tiebreak=())
    index.add("a", intercept=2.0, slope=-1.0, tiebreak=())
    index.remove("z")
    assert index._hi_b == 7e9  # "a" is left: no refresh yet
    rebuilds = index.stats.rebuilds
    for i in range(3):  # an add into the full capacity doubles it
        index.add(i, intercept=float(i), slope=0.0, tiebreak=())
    assert index.stats.rebuilds > rebuilds
    assert (index._hi_b, index._hi_m) == _live_max(index) == (2.0, 1.0)
    index.check()
