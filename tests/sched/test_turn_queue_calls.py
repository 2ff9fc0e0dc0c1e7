"""The queue calls a prefill turn makes, with steps written out or skipped:

- ``KineticIndex.peek`` advances the clock with ``advance``'s steps written
  out (its checks passed): twin indexes, one peeking, the other calling
  ``advance`` then reading the winner as ``peek`` did, must give the same
  answers and end in the same state (clock, epoch, tree, certificates,
  events), errors included;
- ``PrefillQueue._note`` reads a request's scheduled tokens without the
  ``num_scheduled_tokens`` property (a decode lane's issued tokens count);
- ``PrefillTimeCache.current`` tells when ``refresh`` cannot rebuild
  (``Scheduler.turn_run`` then skips the per-turn call).
"""

from __future__ import annotations

import copy
import math
import random
from types import SimpleNamespace

import pytest

from medha_sched.config import ParallelDegrees
from medha_sched.cost.roofline import RooflineCostModel
from medha_sched.policies import get_policy
from medha_sched.prefill_cache import PrefillTimeCache
from medha_sched.priority_index import KineticIndex
from medha_sched.queue import PrefillQueue
from medha_sched.request import Request


def _old_peek(index: KineticIndex, now: float):
    """``peek`` as it was: ``advance``, then the winner matched with the seats."""
    index.advance(now)
    slot = index._win[1]
    if index._hot:
        slot = index._with_hot(slot)
    return None if slot < 0 else index._items[slot]


def _line(rng: random.Random, now: float) -> tuple[float, float]:
    """A line whose key at ``now`` is near the others' (so lines cross soon)."""
    m = rng.choice([0.0, -1.0, rng.uniform(-3.0, 0.0)])
    return rng.uniform(-5.0, 5.0) - m * now, m


def _full_state(index: KineticIndex) -> tuple:
    return (
        index._clock,
        index._epoch,
        dict(index._slot),
        list(index._win),
        list(index._cert),
        list(index._ver),
        sorted(index._events),
        list(index._hot),
        index._hi_b,
        index._hi_m,
    )


@pytest.mark.parametrize("seed", range(4))
def test_peek_advances_as_advance_does(seed: int) -> None:
    rng = random.Random(seed)
    new: KineticIndex[int] = KineticIndex()
    old: KineticIndex[int] = KineticIndex()
    twins = (new, old)
    now, seq, live = 0.0, 0, []
    failed = compacted = 0
    for _ in range(3_000):
        op = rng.random()
        if op < 0.25 or len(live) < 3:
            seq += 1
            b, m = _line(rng, now)
            for t in twins:
                t.add(seq, intercept=b, slope=m, tiebreak=(seq,))
            live.append(seq)
        elif op < 0.7:
            item = rng.choice(live)
            seq += 1
            b, m = _line(rng, now)
            got = [t.renew(item, intercept=b, slope=m, tiebreak=(seq,)) for t in twins]
            assert got[0] == got[1]
            if not got[0]:
                for t in twins:
                    t.remove(item)
                    t.add(item, intercept=b, slope=m, tiebreak=(seq,))
        elif op < 0.8:
            item = live.pop(rng.randrange(len(live)))
            for t in twins:
                t.remove(item)
        # the time: later (mostly), the same, an int, or earlier (an error)
        kind = rng.random()
        if kind < 0.8:
            now += rng.choice([1e-3, 0.05, 2.0, 40.0]) * rng.random()
        elif kind < 0.9:
            now = float(math.floor(now) + 1)
            at: float = int(now)
        if kind >= 0.95:
            at = now - 1.0
            for peek in (new.peek, lambda x: _old_peek(old, x)):
                with pytest.raises(ValueError, match="backwards"):
                    peek(at)
        else:
            at = int(now) if 0.8 <= kind < 0.9 else now
            events = new.stats.events
            before = len(new._events)
            assert new.peek(at) == _old_peek(old, at)
            failed += new.stats.events > events
            compacted += len(new._events) < before
        assert _full_state(new) == _full_state(old)
    for bad in (math.nan, math.inf):
        for t in (copy.deepcopy(new), copy.deepcopy(old)):
            with pytest.raises(ValueError, match="finite"):
                t.peek(bad)
    assert failed > 50  # certificates failed inside peek's advance
    assert compacted > 0  # and the events were compacted there


def test_note_counts_a_lane_s_issued_tokens_as_scheduled() -> None:
    queue = PrefillQueue(get_policy("lars"), short_below=64, long_min=1_000)
    rng = random.Random(2)
    for i in range(200):
        r = Request(f"r{i}", 0.0, rng.randint(8, 2_000), 4)
        r.deadline, r.total_work, r.remaining_work = 5.0, 1.0, 1.0
        scheduled = rng.randint(0, r.num_prefill_tokens - 1)
        if rng.random() < 0.5:
            r._lane = SimpleNamespace(issued=rng.randint(0, 80))
        r.num_scheduled_tokens = scheduled  # the property: _scheduled less the lane's
        queue.push(r)
        left = r.num_prefill_tokens - r.num_scheduled_tokens
        assert queue._short.get(r.request_id) == (left if left < 64 else None)
        assert (r.request_id in queue._not_long) == (r.num_prefill_tokens < 1_000)


class _Learning:
    """The roofline with a revision a test moves (as a learning model's)."""

    def __init__(self, model: RooflineCostModel) -> None:
        self._model = model
        self.revision = 0

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def test_current_tells_when_refresh_cannot_rebuild() -> None:
    layout = ParallelDegrees(tp=8, spp=2, kvp=1)
    static = RooflineCostModel.from_spec({"model": "llama3-8b", "gpu": "a100"}, layout=layout)
    model = _Learning(static)
    cache = PrefillTimeCache(
        model, target_time=0.05, token_grid=32, max_chunk_tokens=8192, group_token_limit=1 << 20
    )
    assert cache.current()
    assert not cache.refresh(0.0) and not cache.refresh(1e9)  # current: never rebuilt
    model.revision = 1
    assert not cache.current()
    assert cache.refresh(0.0) and cache.current()  # rebuilt at 0.0, of revision 1
    model.revision = 2
    assert not cache.current() and not cache.refresh(5.0)  # within the interval
    assert not cache.current() and cache.refresh(10.0) and cache.current()
    plain = PrefillTimeCache(
        static, target_time=0.05, token_grid=32, max_chunk_tokens=8192, group_token_limit=1 << 20
    )
    assert plain.current() and not plain.refresh(1e9)


@pytest.mark.parametrize("bad", [False, True, "0", 0j])
def test_peek_refuses_a_time_that_is_no_float_even_at_the_clock(bad: object) -> None:
    """peek's inline advance takes floats only; any other time goes through
    advance's checks, also when it equals the clock (0.0 == False)."""
    index: KineticIndex[int] = KineticIndex()
    index.add(1, intercept=0.0, slope=1.0, tiebreak=(1,))
    assert index.peek(0.0) == 1
    with pytest.raises((TypeError, ValueError)):
        index.peek(bad)  # type: ignore[arg-type]
