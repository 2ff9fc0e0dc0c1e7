"""``KineticIndex.remove_many`` and ``PrefillQueue.remove_many`` against
removing one item at a time: the same tree, certificates, free slots and
order, now and after the clock moves on (certificates failing)."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.policies import get_policy
from medha_sched.priority_index import KineticIndex
from medha_sched.queue import PrefillQueue
from medha_sched.request import Request


def _build(lines: list[tuple[float, float, int]], churn: list[int], t0: float) -> KineticIndex:
    """An index holding ``lines`` (some removed and re-added: free slots in
    pages), its clock at ``t0``."""
    index: KineticIndex[int] = KineticIndex()
    for i, (b, m, tb) in enumerate(lines):
        index.add(i, intercept=b, slope=m, tiebreak=(tb, i))
    for i in churn:
        if i in index:
            index.remove(i)
    index.advance(t0)
    return index


def _state(index: KineticIndex) -> tuple:
    """Everything that decides a later answer (not the versions, which only
    tell stale heap entries, nor the work counters), with any item in a hot
    seat (``KineticIndex.renew``) back in its leaf, on a copy."""
    index = copy.deepcopy(index)
    index._unseat()
    live = sorted((c, n) for c, n, v in index._events if v == index._ver[n] and index._cert[n] == c)
    return (
        index._clock,
        index._win,
        index._cert,
        index._slot,
        index._items,
        index._tb,
        index._page_free,
        index._open,
        index._num_free,
        live,
    )


_line = st.tuples(
    st.floats(-50.0, 50.0, allow_nan=False).map(lambda x: round(x, 1)),
    st.sampled_from([0.0, -1.0, -0.5, -0.25, -2.0, -0.1, -1.0 / 3.0]),
    st.integers(0, 3),
)


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(_line, min_size=1, max_size=70),
    data=st.data(),
)
def test_remove_many_ends_as_removing_one_by_one(lines, data) -> None:
    n = len(lines)
    churn = data.draw(st.lists(st.integers(0, n - 1), max_size=10, unique=True))
    t0 = data.draw(st.floats(0.0, 20.0, allow_nan=False))
    alive = [i for i in range(n) if i not in churn]
    gone = data.draw(st.permutations(alive)).copy()[: data.draw(st.integers(0, len(alive)))]
    one, many = _build(lines, churn, t0), _build(lines, churn, t0)
    assert _state(one) == _state(many)
    for i in gone:
        one.remove(i)
    many.remove_many(gone)
    many.check()
    assert _state(one) == _state(many)
    assert list(one.iter_sorted(t0)) == list(many.iter_sorted(t0))
    # later: the same certificates fail in the same order, new items take the same slots
    for step, t in enumerate((t0 + 0.7, t0 + 3.0, t0 + 40.0)):
        for index in (one, many):
            index.add(n + step, intercept=float(step), slope=-0.5, tiebreak=(step, n + step))
        assert list(one.iter_sorted(t)) == list(many.iter_sorted(t))
        many.check()
        assert _state(one) == _state(many)


def test_remove_many_of_everything_and_of_nothing() -> None:
    rng = random.Random(3)
    lines = [(rng.uniform(-5, 5), -rng.choice([0.5, 1.0, 2.0]), i) for i in range(40)]
    index = _build(lines, [], 1.0)
    before = _state(index)
    index.remove_many([])
    assert _state(index) == before
    index.remove_many(range(40))
    index.check()
    assert len(index) == 0 and index.peek(2.0) is None
    assert index._num_free == index._cap


def test_remove_many_stops_at_an_absent_item() -> None:
    index = _build([(1.0, 0.0, 0), (2.0, 0.0, 1), (3.0, 0.0, 2)], [], 0.0)
    with pytest.raises(ValueError, match="item 7 is not in the index"):
        index.remove_many([0, 7, 1])
    index.check()
    assert list(index.iter_sorted(0.0)) == [1, 2]


def _request(rid: str, arrival: float, prompt: int, priority: int) -> Request:
    r = Request(rid, arrival, prompt, 4, priority=priority)
    r.deadline = arrival + 2.0
    r.total_work = r.remaining_work = prompt * 1e-4
    return r


def test_queue_remove_many_across_classes() -> None:
    rng = random.Random(5)
    policy = get_policy("lars")
    one, many = PrefillQueue(policy, short_below=64), PrefillQueue(policy, short_below=64)
    reqs = [_request(f"r{i}", rng.uniform(0, 2), rng.randint(8, 400), i % 3) for i in range(60)]
    for q in (one, many):
        for r in reqs:
            q.push(r)
    gone = [r.request_id for r in rng.sample(reqs, 25)] + ["absent"]
    for rid in gone:
        one.remove(rid)
    many.remove_many(gone)
    assert len(many) == 35 and all(rid not in many for rid in gone)
    assert [r.request_id for r in one.iter_sorted(3.0)] == [
        r.request_id for r in many.iter_sorted(3.0)
    ]
    for tokens in (9, 30, 64):
        assert one.has_remaining_below(tokens) == many.has_remaining_below(tokens)
    for index in many._classes.values():
        index.check()


def test_the_scheduler_queue_counts_what_an_iterator_removed() -> None:
    """``_PrefillQueue.remove_many`` reads the ids twice; an iterator must not be
    used up by the first read (the count of prompts that are not long drives the
    scan's early stop)."""
    from medha_sched.scheduler import _PrefillQueue

    queue = _PrefillQueue(get_policy("lars"), short_below=64, long_min=1000)
    requests = []
    for i in range(4):
        r = Request(f"r{i}", 0.0, 100, 4)
        r.deadline, r.total_work, r.remaining_work = 2.0, 0.01, 0.01
        queue.push(r)
        requests.append(r)
    queue.remove_many(r.request_id for r in requests[:2])
    assert len(queue) == 2
    assert queue.num_not_long == 2
