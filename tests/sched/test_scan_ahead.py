"""The scan's early stop when long prompts surely come before every short one.

``Scheduler._pack_prefills`` stops after its first candidate, a long prompt
whose chunk joined (one KVP group: every other long prompt is then blocked),
when ``KineticIndex.count_ahead`` finds more than ``max_consecutive_skips``
long prompts that the walk surely yields before every prompt that is not
long: the scan would meet only blocked long prompts up to its skip limit.
These tests check ``count_ahead`` against the walk itself (every item it
counts comes before every rival, on random lines, crossing ones included),
and whole simulations with the early stop against the same simulations
without it (every record, batch and float the same, and the stop taken).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from medha_sched.priority_index import AHEAD_RTOL, KineticIndex
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler, _PrefillQueue
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sim.same import MIXED_CASES, assert_same_results
from tests.sim.same import mixed_long_short_trace as _mixed_trace
from tests.sim.same import simulate_with_skips as _run

# ----------------------------------------------------------------- count_ahead


def _walk_count(index: KineticIndex, ahead: list[int], behind: list[int], now: float) -> int:
    """How many distinct items of ``ahead`` the walk yields before every one of ``behind``."""
    order = list(index.iter_sorted(now))
    place = {item: i for i, item in enumerate(order)}
    first_rival = min((place[y] for y in behind), default=len(order))
    return len({z for z in ahead if z in place and place[z] < first_rival})


def _crossing_index(rng: random.Random, n: int, now: float) -> tuple[KineticIndex, dict]:
    """``n`` lines in a fresh index, many of them crossing at or near ``now``
    (keys there within a few ulps), advanced in steps to ``now``."""
    index: KineticIndex[int] = KineticIndex()
    lines = {}
    for i in range(n):
        kind = rng.random()
        m = rng.choice([-1.0, -0.5, 0.0, 0.25, 1.0]) * rng.uniform(0.1, 1e3)
        if kind < 0.5:  # crossing a common value at now (to rounding)
            target = rng.choice([1.0, 7.25, 1e3 / 3])
            b = target - m * now
        else:
            b = rng.uniform(-1e4, 1e4)
        lines[i] = (b, m)
        index.add(i, intercept=b, slope=m, tiebreak=(rng.randrange(3), i))
    for t in [*sorted(rng.uniform(0.0, now) for _ in range(3)), now]:
        index.advance(t)
    return index, lines


@pytest.mark.parametrize("seed", range(6))
def test_count_ahead_never_counts_an_item_the_walk_yields_late(seed) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        now = rng.uniform(0.0, 50.0)
        index, lines = _crossing_index(rng, rng.randint(2, 90), now)
        items = list(lines)
        rng.shuffle(items)
        k = rng.randint(1, max(1, len(items) // 4))
        behind, ahead = items[:k], items[k:] + items[k:3]  # repeats are counted once
        got = index.count_ahead(ahead, behind, now)
        assert 0 <= got <= _walk_count(index, ahead, behind, now)
        index.check()  # counting changed nothing in the tree


@pytest.mark.parametrize("seed", range(4))
def test_count_ahead_is_exact_for_separated_keys(seed) -> None:
    # keys a whole unit apart: the walk's order is the keys' order, and the
    # count is every ahead item yielded before the first rival
    rng = random.Random(100 + seed)
    for _ in range(40):
        n = rng.randint(2, 120)
        now = rng.uniform(0.0, 100.0)
        values = rng.sample(range(10 * n), n)
        index: KineticIndex[str] = KineticIndex()
        for i, v in enumerate(values):
            m = rng.uniform(-2.0, 2.0)
            index.add(f"x{i}", intercept=float(v) - m * now, slope=m, tiebreak=(i,))
        names = [f"x{i}" for i in range(n)]
        behind = rng.sample(names, rng.randint(1, n))
        ahead = [x for x in names if x not in behind] + ["absent"]
        want = _walk_count(index, ahead, behind, now)
        assert index.count_ahead(ahead, behind, now) == want


def test_count_ahead_margin_and_edges() -> None:
    index: KineticIndex[str] = KineticIndex()
    index.add("a", intercept=1.0, slope=0.0, tiebreak=(0,))
    index.add("b", intercept=2.0, slope=0.0, tiebreak=(1,))
    index.add("c", intercept=1.0 + 1e-12, slope=0.0, tiebreak=(2,))
    # "a" comes first, but within the margin of "c" it is not counted
    assert next(index.iter_sorted(0.0)) == "a"
    assert index.count_ahead(["a"], ["c"], 0.0) == 0
    assert index.count_ahead(["a", "a"], ["b"], 0.0) == 1
    assert index.count_ahead(["a", "c"], ["b"], 0.0) == 2
    assert index.count_ahead(["a", "b", "gone"], [], 0.0) == 2  # no rival: every queued one
    # the margin grows with the largest magnitude ever stored, and never shrinks
    index.add("huge", intercept=1e9, slope=0.0, tiebreak=(3,))
    index.remove("huge")
    assert AHEAD_RTOL * 1e9 < 1.0  # below the gap of 1 between "a" and "b"
    assert index.count_ahead(["a"], ["b"], 0.0) == 1
    index.add("steep", intercept=0.0, slope=-1e5, tiebreak=(4,))
    index.remove("steep")
    assert AHEAD_RTOL * (1e9 + 1e5 * 1e6) > 1.0  # over it at t = 1e6
    assert index.count_ahead(["a"], ["b"], 1e6) == 0
    with pytest.raises(ValueError, match="time went backwards"):
        index.count_ahead(["a"], ["b"], 0.5)


# ------------------------------------------------------------- whole simulations


def _counting(monkeypatch, skips: int) -> dict[str, int]:
    """Counts of the early-stop checks and of the stops (more than ``skips`` ahead)."""
    counts = {"asked": 0, "stopped": 0}
    ahead = _PrefillQueue.ahead_of_not_long

    def counting(self, request_ids, now):
        got = ahead(self, request_ids, now)
        counts["asked"] += 1
        counts["stopped"] += got > skips
        return got

    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long", counting)
    return counts


def _never(self, request_ids, now) -> int:
    return 0  # the scan never stops early: the plain walk


@pytest.mark.parametrize(
    ("policy", "skips", "spp", "seed"),
    [*MIXED_CASES, ("fcfs", 5, 1, 4)],
)
def test_simulations_match_the_plain_scan(monkeypatch, policy, skips, spp, seed) -> None:
    spec = RunSpec(policy=policy, tp=8, spp=spp, long_threshold=16_384)
    trace = _mixed_trace(seed, longs=3 * skips + 6, shorts=90)
    counts = _counting(monkeypatch, skips)
    fast = _run(trace, spec, skips)
    assert all(r.finish_s is not None for r in fast.records)
    assert counts["stopped"] > 20  # the scan stopped early many times
    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long", _never)
    assert_same_results(fast, _run(trace, spec, skips))


@pytest.mark.parametrize("spp", [2, 4])
def test_an_overloaded_roofline_run_matches_the_plain_scan(monkeypatch, spp) -> None:
    # sim_speed's setting, shorter: 30% long prompts at 2 QPS build a long queue
    trace = generate(WorkloadSpec(qps=2.0, num_requests=200, long_fraction=0.3, seed=2))
    spec = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=spp,
        target_batch_time=0.05,
    )
    counts = _counting(monkeypatch, 16)
    fast = _run(trace, spec, 16)
    assert counts["stopped"] > 100
    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long", _never)
    assert_same_results(fast, _run(trace, spec, 16))


def test_the_stop_needs_more_than_the_skip_limit_ahead() -> None:
    spec = RunSpec(policy="edf", tp=8, spp=2, long_threshold=16_384)
    config, model, cache = spec.build()
    config = dataclasses.replace(config, max_consecutive_skips=3)
    s = Scheduler(config, model, cache=cache)
    for i in range(4):  # edf: earlier deadlines first (ttft 10 s, then 1,000 s)
        s.add_request(Request(f"long{i}", 0.001 * i, 20_000, 2, ttft_slo=10.0))
    s.add_request(Request("short", 0.01, 300, 2, ttft_slo=1_000.0))
    queue = s._queue
    ids = [f"long{i}" for i in range(4)]
    assert queue.ahead_of_not_long(ids, 0.02) == 4
    assert queue.ahead_of_not_long([*ids[:3], "short"], 0.02) == 3
    s.add_request(Request("other", 0.01, 300, 2, ttft_slo=1_000.0, priority=1))
    assert queue.ahead_of_not_long(ids, 0.02) == 0  # two classes: nothing is told
    queue.remove("other")
    assert queue.ahead_of_not_long(ids, 0.02) == 4  # its class is empty: one class again


@pytest.mark.parametrize(
    ("kvp", "kv_tokens", "longs", "seed", "flags"),
    [
        (2, 100_000, 60, 3, {}),  # two KVP groups, prompts over 45,056 tokens sharded
        (1, 120_000, 30, 7, {}),  # a pool of about two long prompts: memory gates admission
        (1, 8_000_000, 30, 7, {"turn_runs": False}),  # every prefill turn through schedule()
    ],
)
def test_kvp_small_pools_and_plain_turns_match_the_plain_scan(
    monkeypatch, kvp, kv_tokens, longs, seed, flags
) -> None:
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
    counts = _counting(monkeypatch, 8)
    fast = _run(trace, spec, 8, **flags)
    assert all(r.finish_s is not None for r in fast.records)
    assert counts["stopped"] > 0  # the early stop was taken
    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long", _never)
    assert_same_results(fast, _run(trace, spec, 8, **flags))


def test_the_proof_is_not_tried_with_many_short_prompts_queued(monkeypatch) -> None:
    """It reads every queued short prompt's key: with more than four skip limits' worth
    it would cost more than the walk (an overloaded fcfs run: 35% slower)."""
    trace = _mixed_trace(4, longs=20, shorts=400)
    trace = [dataclasses.replace(r, arrival_s=r.arrival_s / 20) for r in trace]
    spec = RunSpec(policy="fcfs", tp=8, spp=2, long_threshold=16_384)
    sizes: list[int] = []
    ahead = _PrefillQueue.ahead_of_not_long

    def sized(self, request_ids, now):
        sizes.append(self.num_not_long)
        return ahead(self, request_ids, now)

    decided = 0  # the checks that only this guard can stop (the others would pass)
    reach = Scheduler._shorts_out_of_reach

    def counted(self, first, now):
        nonlocal decided
        cfg = self.config
        skips = cfg.max_consecutive_skips
        decided += (
            len(self._walked) >= skips
            and first.num_prefill_tokens >= cfg.long_prefill_threshold
            and self._queue.num_not_long > 4 * skips
        )
        return reach(self, first, now)

    monkeypatch.setattr(_PrefillQueue, "ahead_of_not_long", sized)
    monkeypatch.setattr(Scheduler, "_shorts_out_of_reach", counted)
    # two skips: enough ids are walked for the proof to be possible (with four
    # this trace never walks that far, and the guard is never what decides)
    _run(trace, spec, 2)
    assert decided > 100 and max(sizes, default=0) <= 8
