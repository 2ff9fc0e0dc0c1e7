"""The scan passes over blocked long prompts in one step.

Once every KVP group runs a long prefill in the draft, a chunk joined, the
budget is not spent and a grid chunk fits somewhere, ``_pack_prefills``'s
visit of a long prompt only counts a skip. It then passes over the long
prompts up to the next short one (``ScanCursor``, the short prompts' places
told by ``KineticIndex.places``), adding their skips, instead of walking to
each. These tests check ``places`` against the walk itself on random lines
(crossing ones included: it must answer the walk's places or None), the
cursor against the walk, and whole simulations with the pass against the same
simulations without it (every record, batch and float the same, and the pass
taken).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from medha_sched.priority_index import KineticIndex
from medha_sched.queue import ScanCursor
from medha_sched.scheduler import Scheduler
from medha_sched.sim import TraceRequest
from medha_sched.sim.engine import Simulator
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sched.test_scan_ahead import _crossing_index
from tests.sim.same import MIXED_CASES, assert_same_results
from tests.sim.same import mixed_long_short_trace as _mixed_trace
from tests.sim.same import simulate_with_skips as _run

# ------------------------------------------------------------------- places


@pytest.mark.parametrize("seed", range(6))
def test_places_are_the_walks_or_none(seed: int) -> None:
    rng = random.Random(seed)
    told = untold = 0
    for _ in range(40):
        now = rng.uniform(1.0, 50.0)
        index, _ = _crossing_index(rng, rng.randint(1, 40), now)
        if rng.random() < 0.5:  # seats taken (renewed in place), then more time
            for item in rng.sample(sorted(index._slot), min(3, len(index))):
                index.renew(
                    item,
                    intercept=rng.uniform(-1e4, 1e4),
                    slope=rng.uniform(-10, 10),
                    tiebreak=(0, item + 1000),
                )
            now += rng.uniform(0.0, 2.0)
        order = list(index.iter_sorted(now))
        where = {item: i for i, item in enumerate(order)}
        some = rng.sample(order, rng.randint(0, min(6, len(order))))
        places = index.places(some, now)
        if places is None:
            untold += 1
            continue
        told += 1
        assert places == {where[item]: item for item in some}
    assert told > 10 and untold > 0


def test_places_of_keys_within_the_margin_are_not_told() -> None:
    index: KineticIndex[str] = KineticIndex()
    index.add("a", intercept=1.0, slope=0.0, tiebreak=(0,))
    index.add("b", intercept=1.0 + 1e-14, slope=0.0, tiebreak=(1,))
    index.add("c", intercept=5.0, slope=0.0, tiebreak=(2,))
    assert index.places(["c"], 0.0) == {2: "c"}
    assert index.places(["a"], 0.0) is None  # b's key is within the margin
    assert index.places([], 0.0) == {}


# ------------------------------------------------------------------- cursor


def test_the_cursor_yields_the_walk_with_passed_places_unknown() -> None:
    rng = random.Random(3)
    for _ in range(200):
        size = rng.randint(1, 30)
        order = [f"r{i}" for i in range(size)]
        shorts = {i: order[i] for i in sorted(rng.sample(range(size), rng.randint(0, size)))}
        cursor = ScanCursor(iter(order), size, lambda s=shorts: dict(s))
        got: list[str | None] = []
        want: list[str | None] = []
        at = 0
        while at < size:
            if rng.random() < 0.3:
                if rng.random() < 0.3 and not cursor.passed:
                    cursor.sync(at)  # (nothing taken outside the cursor here)
                k, short = cursor.longs_ahead()
                nxt = min((p for p in shorts if p >= at), default=None)
                assert (k, short) == ((nxt - at, True) if nxt is not None else (size - at, False))
                if k:
                    cursor.pass_over(k)
                    at += k
                    continue
            r = next(cursor, "end")
            if r is None:
                assert at not in shorts
                if rng.random() < 0.5:
                    r = cursor.resolve()
                    assert r == order[at]
                else:
                    want.append(None)
                    got.append(None)
                    at += 1
                    continue
            got.append(r)
            want.append(order[at])
            at += 1
        assert next(cursor, "end") == "end"
        assert got == want


def test_the_cursor_passes_nothing_when_places_are_not_told() -> None:
    cursor = ScanCursor(iter(["a", "b"]), 2, lambda: None)
    assert cursor.longs_ahead() == (0, False)
    assert cursor.longs_ahead() == (0, False)
    assert list(cursor) == ["a", "b"]


# -------------------------------------------------------------- simulations


def _counting(monkeypatch) -> dict[str, int]:
    """Passes made by ``_pass_blocked`` and by a joined scan's second visit
    (``_second_visit``: a cursor past the long prompts before the first short
    one), counted."""
    counts = {"passed": 0, "places": 0}
    passing, second = Scheduler._pass_blocked, Scheduler._second_visit

    def counted(self, cursor, skips, seen):
        out = passing(self, cursor, skips, seen)
        counts["passed"] += out != skips
        return out

    def counted_second(self, draft, walk, now, spent, max_skips):
        cursor, skips = second(self, draft, walk, now, spent, max_skips)
        counts["passed"] += cursor is not None and cursor.passed
        return cursor, skips

    monkeypatch.setattr(Scheduler, "_pass_blocked", counted)
    monkeypatch.setattr(Scheduler, "_second_visit", counted_second)
    return counts


def _never(self, cursor, skips, seen) -> int:
    return skips  # the scan never passes over: the plain walk


def _walks(self, draft, walk, now, spent, max_skips):
    return None, 0  # a joined scan's second candidate is walked to: the plain walk


def _plain_walk(monkeypatch) -> None:
    """The scan walks to every candidate it visits (no pass over long prompts)."""
    monkeypatch.setattr(Scheduler, "_pass_blocked", _never)
    monkeypatch.setattr(Scheduler, "_second_visit", _walks)


@pytest.mark.parametrize(("policy", "skips", "spp", "seed"), [*MIXED_CASES, ("fcfs", 5, 1, 4)])
def test_simulations_match_the_walk(monkeypatch, policy, skips, spp, seed) -> None:
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = _mixed_trace(seed, longs=3 * skips + 6, shorts=90)
    counts = _counting(monkeypatch)
    fast = _run(trace, spec, skips)
    assert all(r.finish_s is not None for r in fast.records)
    assert counts["passed"] > 5
    _plain_walk(monkeypatch)
    assert_same_results(fast, _run(trace, spec, skips))


@pytest.mark.parametrize(("spp", "flags"), [(2, {}), (4, {}), (2, {"turn_runs": False})])
def test_an_overloaded_roofline_run_matches_the_walk(monkeypatch, spp, flags) -> None:
    trace = generate(WorkloadSpec(qps=2.0, num_requests=200, long_fraction=0.3, seed=2))
    spec = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=spp,
        target_batch_time=0.05,
    )
    counts = _counting(monkeypatch)
    fast = _run(trace, spec, 16, **flags)
    assert counts["passed"] > 100
    _plain_walk(monkeypatch)
    assert_same_results(fast, _run(trace, spec, 16, **flags))


@pytest.mark.parametrize(
    ("kvp", "kv_tokens", "longs", "seed"),
    [(2, 100_000, 60, 3), (1, 120_000, 30, 7)],
)
def test_kvp_and_small_pools_match_the_walk(monkeypatch, kvp, kv_tokens, longs, seed) -> None:
    spec = RunSpec(
        policy="lars-mp",
        tp=8,
        spp=2,
        kvp=kvp,
        kv_cache_tokens=kv_tokens,
        max_tokens_per_group=45_056 if kvp > 1 else None,
        long_threshold=16_384,
    )
    trace = _mixed_trace(seed, longs=longs, shorts=90)
    fast = _run(trace, spec, 8)
    _plain_walk(monkeypatch)
    assert_same_results(fast, _run(trace, spec, 8))


# ------------------------------------------------------------ per-scan twins


def _scan_state(sched: Scheduler, draft) -> tuple:
    """What one scan leaves behind: the draft's entries, floor, room and time, and
    the scheduler's walked ids and queue (what a later scan or turn reads). The
    walked ids as ``_shorts_out_of_reach`` reads them: fewer than
    ``max_consecutive_skips`` make it answer False at once, as none do."""
    walked = list(sched._walked)
    if len(walked) < sched.config.max_consecutive_skips:
        walked = []
    return (
        [(r.request_id, n) for r, n in draft.entries],
        draft.floor,
        draft.fits_somewhere,
        draft.cost.time,
        draft.num_tokens,
        walked,
        len(sched._queue),
        sorted(sched._queue._not_long),
    )


def _blocked_long_trace(rng: random.Random, grid: int, long_min: int) -> list[TraceRequest]:
    """Long prompts arriving together early (half of them within a few grid
    chunks of the threshold), short ones with and without TTFT deadlines after."""
    longs = [
        TraceRequest(
            f"L{i}",
            rng.uniform(0, 3),
            long_min + rng.randint(0, 3) * grid + rng.randint(1, grid - 1)
            if rng.random() < 0.5
            else long_min + rng.randint(0, 60_000),
            rng.randint(1, 8),
        )
        for i in range(rng.randint(6, 12))
    ]
    shorts = [
        TraceRequest(
            f"s{i}",
            rng.uniform(0, 12),
            rng.randint(1, 2000),
            rng.randint(1, 40),
            ttft_slo_s=rng.choice([None, 0.3, 5.0, 100.0]),
        )
        for i in range(rng.randint(20, 50))
    ]
    return sorted(longs + shorts, key=lambda r: (r.arrival_s, r.id))


@pytest.mark.parametrize("seed", [3, 9])  # seeds whose runs take the pass
def test_each_scan_leaves_what_the_walk_leaves(monkeypatch, seed: int) -> None:
    """Every ``_pack_prefills`` call is also run on a deep copy of the scheduler
    and its draft with the pass turned off: the two return the same ids and leave
    the same state (entries, floor, room, time, walked ids, queue), which whole
    simulations do not show (``_walked`` feeds only an early stop that changes no
    decision). These runs do not reach the guard on meeting a short prompt:
    breaking it still passes here."""
    scan, second = Scheduler._pack_prefills, Scheduler._second_visit
    counts = {"scans": 0, "passes": 0}

    def walk(self, cursor, skips, seen):
        return skips

    def counted(self, cursor, skips, seen):
        out = Scheduler._pass_blocked.__wrapped__(self, cursor, skips, seen)
        counts["passes"] += out != skips
        return out

    counted.__wrapped__ = Scheduler._pass_blocked

    def twin(self, draft, now, *, take=True, joined=None):
        other, other_draft = copy.deepcopy((self, draft))
        other_joined = None if joined is None else other._requests[joined.request_id]
        monkeypatch.setattr(Scheduler, "_pass_blocked", walk)
        monkeypatch.setattr(Scheduler, "_second_visit", _walks)
        want = scan(other, other_draft, now, take=take, joined=other_joined)
        monkeypatch.setattr(Scheduler, "_pass_blocked", counted)
        monkeypatch.setattr(Scheduler, "_second_visit", second)
        got = scan(self, draft, now, take=take, joined=joined)
        assert got == want
        assert _scan_state(self, draft) == _scan_state(other, other_draft)
        counts["scans"] += 1
        return got

    monkeypatch.setattr(Scheduler, "_pass_blocked", counted)
    monkeypatch.setattr(Scheduler, "_pack_prefills", twin)
    rng = random.Random(seed)
    grid, long_min = rng.choice([64, 256]), rng.choice([2048, 8192])
    spec = RunSpec(policy="lars-mp", tp=8, spp=2, long_threshold=long_min)
    config, model, cache = spec.build()
    config = dataclasses.replace(config, max_consecutive_skips=rng.choice([3, 8]), token_grid=grid)
    Simulator(config, model, cache=cache).run(_blocked_long_trace(rng, grid, long_min))
    assert counts["scans"] > 0 and counts["passes"] > 0  # the pass was taken
