"""``CacheConfig(block_ids=False)``: blocks counted, not named
(:class:`medha_sched.block_counter.BlockCounter`).

The counter must give every count the pool gives for the same calls, the KV
manager the same answers with either, and a scheduler the same batches (only
the block ids differ, all -1 when counted)."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha_sched import AffineCostModel, ParallelDegrees
from medha_sched.block_counter import NO_ID, BlockCounter
from medha_sched.block_pool import BlockPool
from medha_sched.config import CacheConfig, SchedulerConfig
from medha_sched.errors import SchedulerError
from medha_sched.kv_memory import KVBlockManager
from medha_sched.output import ScheduleOutput
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler

from .harness import run
from .strategies import setups, workloads


def counts(pool: BlockPool | BlockCounter) -> tuple[int, ...]:
    return pool.num_free, pool.num_used, pool.num_cached, pool.num_allocs, pool.num_frees


# ------------------------------------------------------------------ the counter
@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_counter_counts_as_the_pool_does(blocks: int, seed: int) -> None:
    rng = random.Random(seed)
    pool, counter = BlockPool(0, blocks), BlockCounter(0, blocks)
    held: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (pool's, counter's)
    for _ in range(60):
        if held and rng.random() < 0.4:
            mine, theirs = held.pop(rng.randrange(len(held)))
            pool.release_allocated("r", list(mine))
            counter.release_allocated("r", list(theirs))
        else:
            n = rng.randint(0, blocks)
            if n > pool.num_free:
                for p in (pool, counter):
                    with pytest.raises(AssertionError, match=f"{n} blocks asked"):
                        p.allocate("r", n)
            else:
                mine, theirs = pool.allocate("r", n), counter.allocate("r", n)
                assert theirs == (NO_ID,) * n and len(mine) == n
                held.append((mine, theirs))
        assert counts(counter) == counts(pool)
        pool.check()
        counter.check()


def test_counter_refuses_what_it_cannot_do() -> None:
    c = BlockCounter(3, 4)
    ids = c.allocate("a", 3)
    with pytest.raises(AssertionError, match="released 4 blocks, only 3 are held"):
        c.release_allocated("a", [NO_ID] * 4)
    with pytest.raises(AssertionError, match="block 7 released by 'a'"):
        c.release("a", [NO_ID, 7])
    assert counts(c) == (1, 3, 0, 3, 0)  # the refusals changed nothing
    c.release("a", list(ids))
    assert counts(c) == (4, 0, 0, 3, 3)
    assert c.lookup("h") is None and not c.is_cached(NO_ID) and c.hash_of(NO_ID) is None
    with pytest.raises(AssertionError, match="cannot cache a prefix"):
        c.register(NO_ID, "h")
    with pytest.raises(AssertionError, match="shares no blocks"):
        c.acquire(NO_ID)


def test_block_ids_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="block_ids must be True or False, got 'no'"):
        CacheConfig(block_ids="no")  # type: ignore[arg-type]


# ------------------------------------------------------------- the KV manager
def twins(groups: int, blocks: int, gmax_blocks: int, wm: float) -> list[KVBlockManager]:
    cache = CacheConfig(
        block_size=4,
        num_blocks_per_group=blocks,
        max_tokens_per_group=4 * gmax_blocks,
        watermark=wm,
    )
    return [KVBlockManager(c, num_groups=groups) for c in (cache, replace(cache, block_ids=False))]


def view(m: KVBlockManager, rids) -> tuple:
    """Everything but the ids: free counts, and per request its groups, shard
    lengths, capacity and the lengths of its new blocks."""
    live = [r for r in rids if r in m]
    return (
        m.free_blocks(),
        [m.num_used_blocks(g) for g in range(m.num_groups)],
        [sorted(m.holders(g)) for g in range(m.num_groups)],
        m.usage(),
        m.num_block_allocs,
        m.num_block_frees,
        {
            r: (
                m.groups_of(r),
                [len(b) for b in m.block_table(r)],
                m.num_tokens_capacity(r),
                [(g, len(ids)) for g, ids in m.pop_new_blocks(r)],
            )
            for r in live
        },
    )


@settings(max_examples=150, deadline=None)
@given(
    groups=st.integers(1, 3),
    blocks=st.integers(8, 40),
    gmax=st.integers(2, 8),
    wm=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_manager_answers_alike_with_ids_or_counts(groups, blocks, gmax, wm, seed) -> None:
    gmax = min(gmax, blocks)
    named, counted = twins(groups, blocks, gmax, wm)
    rng = random.Random(seed)
    rids = list(range(8))
    for _ in range(80):
        op, rid, tokens = rng.choice("aaegGf"), rng.choice(rids), rng.randint(1, 8 * gmax)
        answers = []
        for m in (named, counted):
            if op == "a" and rid not in m:
                answers.append(m.admit(rid, tokens))
            elif op == "e" and rid in m:
                answers.append(m.ensure_capacity(rid, m.num_tokens_capacity(rid) + 3))
            elif op == "g" and rid in m:
                answers.append(m.ensure_capacity_many([(rid, m.num_tokens_capacity(rid) + 1)]))
            elif op == "G":
                tails = [r for r in rids if r in m and len(m.block_table(r)[-1]) < gmax]
                group = m.tail_group(tails[0]) if tails else 0
                on = [r for r in tails if m.tail_group(r) == group]
                got = m.grow_tails(group, on) if on else ()
                answers.append(None if got is None else len(got))
            elif op == "f" and rid in m:
                m.free(rid)
        assert answers[: len(answers) // 2] == answers[len(answers) // 2 :]
        assert view(named, rids) == view(counted, rids)
        named.check_invariants()
        counted.check_invariants()
    assert all(set(ids) == {NO_ID} for r in rids if r in counted for ids in counted.block_table(r))


@settings(max_examples=150, deadline=None)
@given(
    groups=st.integers(1, 3),
    blocks=st.integers(8, 40),
    gmax=st.integers(2, 8),
    ids=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_grow_tails_unspelled_leaves_what_grow_tails_leaves(groups, blocks, gmax, ids, seed):
    """Twins (blocks named or counted), one growing tails by ``grow_tails``, the
    other by ``grow_tails_unspelled`` from an iterator: the same answers, block
    tables (ids included) and counts after every step."""
    cache = twins(groups, blocks, gmax, 0.0)[0 if ids else 1].cache
    old, new = (KVBlockManager(cache, num_groups=groups) for _ in range(2))
    rng = random.Random(seed)
    rids = list(range(8))
    for _ in range(80):
        op, rid, tokens = rng.choice("aaGGGf"), rng.choice(rids), rng.randint(1, 8 * gmax)
        if op == "a" and rid not in old:
            assert old.admit(rid, tokens) == new.admit(rid, tokens)
        elif op == "G":
            tails = [r for r in rids if r in old and len(old.block_table(r)[-1]) < gmax]
            group = old.tail_group(tails[0]) if tails else 0
            on = [r for r in tails if old.tail_group(r) == group]
            got = old.grow_tails(group, on)
            assert new.grow_tails_unspelled(group, iter(on), len(on)) is (got is not None)
        elif op == "f" and rid in old:
            old.free(rid)
            new.free(rid)
        assert view(old, rids) == view(new, rids)
        assert [old.block_table(r) for r in rids if r in old] == [
            new.block_table(r) for r in rids if r in new
        ]
        new.check_invariants()


def test_counted_blocks_have_no_reference_counts() -> None:
    _, counted = twins(1, 8, 4, 0.0)
    assert counted.admit("a", 5)
    assert counted.block_table("a") == ((NO_ID, NO_ID),)
    with pytest.raises(SchedulerError, match="block_ids=False"):
        counted.ref_count(0, NO_ID)


def test_check_invariants_sees_a_lost_count() -> None:
    _, counted = twins(2, 8, 4, 0.0)
    assert counted.admit("a", 9)
    pool = counted._pools[0]
    pool._num_held -= 1  # a block the shards hold, no longer counted (the pool agrees)
    pool.num_allocs -= 1
    pool.check()
    with pytest.raises(AssertionError, match="blocks counted held, the shards hold"):
        counted.check_invariants()


# --------------------------------------------------------------- the scheduler
def shape(out: ScheduleOutput) -> tuple:
    """A batch without its block ids: the number of new blocks per group instead."""
    chunks = [
        (
            c.request_id,
            c.start,
            c.num_tokens,
            c.kvp_groups,
            c.samples,
            [(g, len(ids)) for g, ids in c.new_blocks],
        )
        for c in out.chunks
    ]
    grants = [(g, rids, len(ids)) for g, rids, ids in out.decodes.new_blocks]
    return out.batch_id, out.time, out.predicted_time, out.preempted, chunks, grants


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scheduler_batches_are_the_same_with_counted_blocks(data) -> None:
    named = data.draw(setups(tight_memory=True), label="setup")
    counted = Scheduler(named.config, named.cost_model, cache=replace(named.cache, block_ids=False))
    requests = data.draw(workloads(named, heavy=True), label="workload")
    twin = copy.deepcopy(requests)  # (a run changes its requests)
    a = run(named, requests)
    b = run(counted, twin)
    assert [shape(o) for o in a.outputs] == [shape(o) for o in b.outputs]
    assert a.finished.keys() == b.finished.keys()


def test_counted_blocks_refuse_a_prefix_to_share() -> None:
    model = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-8, layout=ParallelDegrees())
    cache = CacheConfig(enable_prefix_caching=True, block_ids=False)
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), model, cache=cache)
    with pytest.raises(SchedulerError, match=r"request 'p' carries prefix content.*block_ids"):
        sched.add_request(Request("p", 0.0, 64, 4, prefix_id="doc", prefix_tokens=32))
    with pytest.raises(SchedulerError, match=r"request 't' carries prefix content"):
        sched.add_request(Request.from_tokens("t", 0.0, [1, 2, 3], max_output_tokens=4))
    sched.add_request(Request("q", 0.0, 64, 4))  # nothing to share: accepted
    sched.add_request(Request("r", 0.0, 64, 4, prefix_id="doc", prefix_caching=False))
    assert sched.get_request("p") is None and sched.get_request("t") is None
    assert sched.get_request("q") is not None and sched.get_request("r") is not None
