"""``KineticIndex.renew`` / ``PrefillQueue.renew``: a remove then add in one step.

Where ``renew`` accepts, the index must end exactly as after ``remove`` then
``add`` (same slots, winners, certificates, free lists), so every later
decision is the same; where it refuses, nothing may change.
"""

from __future__ import annotations

import copy
import random

import pytest

from medha_sched.policies import get_policy
from medha_sched.priority_index import KineticIndex
from medha_sched.queue import PrefillQueue
from medha_sched.request import Request


def _state(index: KineticIndex) -> tuple:
    """Slots, tree and free lists, with any item in a hot seat back in its leaf
    (on a copy: the seats change no answer)."""
    index = copy.deepcopy(index)
    index._unseat()
    return (
        dict(index._slot),
        list(index._win),
        list(index._cert),
        list(index._b),
        list(index._m),
        list(index._tb),
        [list(p) for p in index._page_free],
        list(index._open),
        index._num_free,
        index._cap,
    )


def _line(rng: random.Random) -> tuple[float, float]:
    return rng.uniform(-50.0, 50.0), rng.choice([0.0, -1.0, -0.5, rng.uniform(-2.0, 0.0)])


@pytest.mark.parametrize("seats", [3, 0])
def test_renew_equals_remove_then_add(seats: int) -> None:
    """With hot seats (the default) and without (every renewal repaired in the tree)."""
    rng = random.Random(7)
    twin_a: KineticIndex[int] = KineticIndex()
    twin_b: KineticIndex[int] = KineticIndex()
    twin_b._seats = seats
    now, seq, accepted, moved, refused = 0.0, 0, 0, 0, 0
    live: list[int] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.3 or len(live) < 3:
            b, m = _line(rng)
            seq += 1
            for t in (twin_a, twin_b):
                t.add(seq, intercept=b, slope=m, tiebreak=(seq,))
            live.append(seq)
        elif op < 0.4:
            item = live.pop(rng.randrange(len(live)))
            for t in (twin_a, twin_b):
                t.remove(item)
        elif op < 0.5:
            now += rng.uniform(0.0, 3.0)
            assert twin_a.peek(now) == twin_b.peek(now)
        else:
            item = rng.choice(live)
            b, m = _line(rng)
            if rng.random() < 0.7:  # mostly the slope it had (a prefill's next chunk)
                m = twin_a._m[twin_a._slot[item]]
            tb = (10_000 + step,)
            before = _state(twin_b)
            slot = twin_b._slot[item]
            move = rng.random() < 0.7  # else refused where the pair would move it
            if twin_b.renew(item, intercept=b, slope=m, tiebreak=tb, move=move):
                accepted += 1
                moved += twin_b._slot[item] != slot
                twin_a.remove(item)
                twin_a.add(item, intercept=b, slope=m, tiebreak=tb)
            else:
                refused += 1
                assert _state(twin_b) == before  # nothing changed
                for t in (twin_a, twin_b):
                    t.remove(item)
                    t.add(item, intercept=b, slope=m, tiebreak=tb)
        assert _state(twin_a) == _state(twin_b)
        if step % 500 == 0:
            twin_b.check()
    # every branch was taken: in place, moved, refused (move=False)
    assert accepted - moved > 100 and moved > 50 and refused > 20
    assert list(twin_a.iter_sorted(now)) == list(twin_b.iter_sorted(now))


def test_queue_renew_is_a_new_insertion() -> None:
    """Tie-breaks: a renewed request goes after one pushed before it with an equal key."""
    policy = get_policy("fcfs")
    q1, q2 = PrefillQueue(policy, short_below=16), PrefillQueue(policy, short_below=16)
    reqs = [Request(f"r{i}", 1.0, 100, 5) for i in range(3)]  # equal arrivals: seq decides
    for q in (q1, q2):
        for r in reqs:
            q.push(r)
    q1.remove("r0")
    q1.push(reqs[0])
    q2.renew(reqs[0])
    order = [r.request_id for r in q2.iter_sorted(2.0)]
    assert order == [r.request_id for r in q1.iter_sorted(2.0)] == ["r1", "r2", "r0"]
    reqs[1].num_scheduled_tokens = 90  # 10 tokens left: below short_below
    q1.remove("r1")
    q1.push(reqs[1])
    q2.renew(reqs[1])
    assert q1.has_remaining_below(11) and q2.has_remaining_below(11)
    assert not q2.has_remaining_below(10)
    assert [r.request_id for r in q2.iter_sorted(3.0)] == ["r2", "r0", "r1"]
