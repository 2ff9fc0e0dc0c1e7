"""``KineticIndex.count_ahead_memo`` gives ``count_ahead``'s answer.

It keeps a bound on the keys of one list of ids (``AheadMemo``) and reads
only the seated ones' keys while the index changes no line, slot or seat but
a seated item's renewal in place. Twin answers after every random operation
(adds, updates, renewals seated or not, moves, removals, clock advances, a
capacity doubling), with lines that cross the ``behind`` keys often; and whole
simulations with the memo against the same simulations with
``ahead_of_not_long`` asked every time (the form before the memo).
"""

from __future__ import annotations

import random

import pytest

from medha_sched.priority_index import AheadMemo, KineticIndex
from medha_sched.scheduler import Scheduler, _PrefillQueue
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sim.same import MIXED_CASES, assert_same_results, paper_spec
from tests.sim.same import mixed_long_short_trace as _mixed_trace
from tests.sim.same import simulate_with_skips as _run


def _made(index: KineticIndex) -> int:
    """How many memos ``index`` has made (its ``_make_memo`` counted)."""
    if "_make_memo" not in vars(index):
        make = index._make_memo
        index.made = 0

        def counted(memo, ids):
            index.made += 1
            make(memo, ids)

        index._make_memo = counted
    return index.made


class _Twin:
    """An index with items ``a*`` (ahead, nearly parallel lines, below the
    ``b*`` items at first) and ``b*`` (behind, steeper: they overtake), asked
    both ways after each operation."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.index: KineticIndex[str] = KineticIndex()
        self.memo = AheadMemo()
        self.now = 0.0
        self.seq = 0
        self.hits = self.asked = self.made = 0
        for i in range(24):
            self.add(f"a{i}")
        for i in range(4):
            self.add(f"b{i}")
        self.ids = [f"a{i}" for i in range(1, 20)] + ["gone"]  # one id never in it

    def line(self, item: str) -> tuple[float, float]:
        rng = self.rng
        if item.startswith("a"):
            return self.now * 0.01 + rng.uniform(0.0, 10.0), -rng.uniform(0.0, 0.02)
        return 15.0 + self.now * 0.5 + rng.uniform(0.0, 5.0), -rng.uniform(0.05, 0.5)

    def add(self, item: str) -> None:
        b, m = self.line(item)
        self.seq += 1
        self.index.add(item, intercept=b, slope=m, tiebreak=(self.seq,))

    def step(self) -> None:
        rng, index = self.rng, self.index
        live = sorted(index._slot, key=str)
        op = rng.random()
        if op > 0.55 and rng.random() < 0.5:
            op = rng.random() * 0.35  # as many renewals as clock steps
        item = rng.choice(live)
        if op < 0.35:  # renewals: the same few items, as the prefill turns do
            item = rng.choice(["a1", "a2", "a1", "a2", "a3", item])
            if item in index:
                b, m = self.line(item)
                if rng.random() < 0.3:
                    b += rng.choice([30.0, 1e3])  # far behind every b* key
                self.seq += 1
                index.renew(item, intercept=b, slope=m, tiebreak=(self.seq,))
        elif op < 0.45:  # a behind item's line anew, or any item's (far behind at times)
            if rng.random() < 0.6:
                item = rng.choice([x for x in live if x.startswith("b")] or [item])
            b, m = self.line(item)
            index.update(item, intercept=b + rng.choice([0.0] * 9 + [40.0]), slope=m)
        elif op < 0.5 and len(live) > 8:
            index.remove(item)
        elif op < 0.55:
            name = rng.choice([f"a{i}" for i in range(30)] + ["b9", "gone"])
            if name not in index:
                self.add(name)
        else:
            self.now += rng.choice([0.0, 0.01, 0.3, 1.0])
        self.ask()

    def ask(self) -> None:
        index, memo = self.index, self.memo
        behind = [x for x in index._slot if x.startswith("b")]
        first = self.rng.choice(["a0", "a1", "a25", "b0", "gone"])
        made = _made(index)
        got = index.count_ahead_memo(memo, first, self.ids, behind, self.now)
        assert got == index.count_ahead([first, *self.ids], behind, self.now)
        self.asked += 1
        self.hits += _made(index) == made
        index.check()


@pytest.mark.parametrize("seed", range(12))
def test_the_memo_gives_count_aheads_answer(seed: int) -> None:
    twin = _Twin(seed)
    for _ in range(400):
        twin.step()
    assert twin.hits > 0  # answered from the memo, not only made again


def test_a_new_list_or_index_makes_the_memo_again() -> None:
    twin = _Twin(99)
    twin.ask()
    twin.ask()
    assert twin.hits == 1
    twin.ids = list(twin.ids)  # equal, not the same list
    twin.ask()
    assert twin.memo.ids is twin.ids and twin.hits == 1
    twin.ask()
    assert twin.hits == 2
    other: KineticIndex[str] = KineticIndex()
    other.add("a1", intercept=0.0, slope=0.0, tiebreak=())
    other.add("b0", intercept=5.0, slope=0.0, tiebreak=())
    assert other.count_ahead_memo(twin.memo, "x", twin.ids, ["b0"], 0.0) == 1
    assert twin.memo.index is other


def test_a_doubling_makes_the_memo_again() -> None:
    twin = _Twin(7)
    twin.ask()
    lines = twin.index._lines
    while twin.index._num_free:
        twin.add(f"a{100 + twin.seq}")
    twin.add("a999")  # doubles the capacity: every slot moves
    assert twin.index._lines != lines
    twin.ask()


# ------------------------------------------------------------ whole simulations


def _plain(self: _PrefillQueue, first: str, walked: list[str], now: float) -> int:
    return self.ahead_of_not_long([first, *walked], now)


def _counting(monkeypatch) -> dict[str, int]:
    """Patch in a check of every answer against ``ahead_of_not_long``."""
    counts = {"calls": 0, "hits": 0}
    memo_form = _PrefillQueue.ahead_of_not_long_memo

    def checked(self, first, walked, now):
        (index,) = self._classes.values() if len(self._classes) == 1 else (None,)
        made = None if index is None else _made(index)
        got = memo_form(self, first, walked, now)
        counts["calls"] += 1
        counts["hits"] += made is not None and _made(index) == made
        assert got == _plain(self, first, walked, now)
        return got

    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long_memo", checked)
    return counts


@pytest.mark.parametrize(("policy", "skips", "spp", "seed"), MIXED_CASES[:3])
def test_mixed_simulations_match_the_plain_count(monkeypatch, policy, skips, spp, seed) -> None:
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = _mixed_trace(seed, longs=3 * skips + 6, shorts=90)
    counts = _counting(monkeypatch)
    fast = _run(trace, spec, skips)
    assert counts["calls"] > 20
    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long_memo", _plain)
    assert_same_results(fast, _run(trace, spec, skips))


def test_an_overloaded_roofline_run_matches_the_plain_count(monkeypatch) -> None:
    trace = generate(WorkloadSpec(qps=2.0, num_requests=200, long_fraction=0.3, seed=2))
    spec = paper_spec()
    counts = _counting(monkeypatch)
    fast = _run(trace, spec, 16)
    assert counts["hits"] > 100  # answered from the memo
    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long_memo", _plain)
    assert_same_results(fast, _run(trace, spec, 16))


def test_the_scheduler_asks_with_the_memo(monkeypatch) -> None:
    trace = generate(WorkloadSpec(qps=2.0, num_requests=120, long_fraction=0.3, seed=2))
    counts = _counting(monkeypatch)
    _run(trace, paper_spec(), 16)
    assert counts["calls"] > 0
    assert Scheduler._shorts_out_of_reach.__doc__  # (the caller, documented)
