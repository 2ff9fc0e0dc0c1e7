"""``BlockPool`` records runs of consecutive ids on its free stack, so that a long
allocation (``allocate_runs``) and its release (``release_runs``) set and check
reference counts a slice per run. The ids handed out, the stack and the counts
must be exactly those of ``allocate`` / ``release_allocated`` (twin pools driven
alike), the records must stay true (``check``), and a refused release must
change nothing. ``KVBlockManager`` keeps each request's runs and frees by them:
twin managers, one with the runs forgotten before each free, must agree.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.block_pool import BlockPool
from medha_sched.config import CacheConfig
from medha_sched.kv_memory import KVBlockManager


def _state(pool: BlockPool) -> tuple[list[int], list[int], int, int, int, list[int]]:
    return (
        list(pool._ref),
        list(pool._free),
        pool.num_used,
        pool.num_frees,
        pool.num_allocs,
        list(pool._cached),
    )


def _is_run(blocks: list[int]) -> bool:
    return max(blocks) - min(blocks) == len(blocks) - 1 == len(set(blocks)) - 1


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(40, 3000))
def test_runs_give_and_take_back_what_the_plain_calls_do(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    plain, runs = BlockPool(0, num_blocks), BlockPool(0, num_blocks)
    held: list[tuple[list[int], list[tuple[int, int]]]] = []
    recorded = 0
    for step in range(150):
        op = rng.random()
        if op < 0.45 and plain.num_free:
            count = rng.randint(1, min(plain.num_free, rng.choice([4, 40, 400])))
            want = plain.allocate(step, count)
            got, found = runs.allocate_runs(step, count)
            assert got == want
            for offset, n in found:
                assert n >= 16 and _is_run(list(got[offset : offset + n]))
            recorded += len(found)
            held.append((list(got), found))
        elif op < 0.6 and held and plain.num_free:  # a decode's block on a held list
            blocks, _ = rng.choice(held)
            block = plain.allocate(step, 1)
            assert runs.allocate(step, 1) == block
            blocks.extend(block)
        elif held:
            blocks, found = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.3:  # backwards, as a prefix-caching manager frees
                blocks = blocks[::-1]
                found = [(len(blocks) - o - n, n) for o, n in reversed(found)]
            plain.release_allocated(step, blocks)
            runs.release_runs(step, blocks, found)
        assert _state(runs) == _state(plain)
        runs.check()
    if num_blocks >= 400:
        assert recorded, "no run was recorded: the slices went untested"


def test_a_run_released_twice_raises_and_changes_nothing() -> None:
    pool = BlockPool(0, 256)
    pool.allocate("x", 5)
    blocks, found = pool.allocate_runs("a", 100)
    assert found == [(0, 100)] and blocks == tuple(range(5, 105))
    extra = pool.allocate("a", 3)
    listed = [*blocks, *extra]
    pool.release_runs("a", listed, found)
    pool.check()
    before = _state(pool)
    with pytest.raises(AssertionError, match="more often than held"):
        pool.release_runs("a", listed, found)
    assert _state(pool) == before
    pool.check()


@pytest.mark.parametrize("where", ["gap", "run", "last gap"])
def test_a_block_not_held_anywhere_in_the_list_changes_nothing(where: str) -> None:
    pool = BlockPool(0, 256)
    first = pool.allocate("x", 3)
    blocks, found = pool.allocate_runs("a", 50)
    listed = [*first, *blocks, *pool.allocate("a", 2)]
    found = [(3 + o, n) for o, n in found]
    victim = {"gap": first[1], "run": blocks[20], "last gap": listed[-1]}[where]
    pool.release("a", [victim])  # now the list names a block nobody holds
    before = _state(pool)
    with pytest.raises(AssertionError, match="more often than held"):
        pool.release_runs("a", listed, found)
    assert _state(pool) == before
    pool.check()


def test_runs_that_are_not_runs_go_the_general_way() -> None:
    pool, twin = BlockPool(0, 128), BlockPool(0, 128)
    blocks, _ = pool.allocate_runs("a", 40)
    twin.allocate("a", 40)
    shuffled = list(blocks)
    random.Random(1).shuffle(shuffled)
    pool.release_runs("a", shuffled, [(0, 20)])  # ends not 19 apart: refused, then general
    twin.release_allocated("a", shuffled)
    assert _state(pool) == _state(twin)
    pool.check()


def test_a_shared_block_in_a_run_is_kept() -> None:
    pool = BlockPool(0, 128)
    blocks, found = pool.allocate_runs("a", 32)
    pool.acquire(blocks[7])
    pool.release_runs("a", list(blocks), found)
    assert pool.ref_count(blocks[7]) == 1 and pool.num_used == 1
    pool.check()


def test_hashed_blocks_go_to_the_cache_as_with_release_allocated() -> None:
    pool, twin = BlockPool(0, 128), BlockPool(0, 128)
    for p in (pool, twin):
        p.allocate("x", 3)
    blocks, found = pool.allocate_runs("a", 40)
    assert twin.allocate("a", 40) == blocks
    for p in (pool, twin):
        for i in (0, 1, 2, 30):
            assert p.register(blocks[i], ("h", i))
    pool.release_runs("a", list(blocks), found)
    twin.release_allocated("a", list(blocks))
    assert _state(pool) == _state(twin)
    assert pool.num_cached == 4
    pool.check()


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_manager_frees_by_runs_as_it_would_block_by_block(caching: bool, seed: int) -> None:
    rng = random.Random(seed)
    cache = CacheConfig(
        block_size=4,
        num_blocks_per_group=3000,
        max_tokens_per_group=4 * 1000,
        watermark=0.0,
        enable_prefix_caching=caching,
    )
    m, twin = KVBlockManager(cache, num_groups=3), KVBlockManager(cache, num_groups=3)
    live: dict[int, int] = {}
    with_runs = 0
    for step in range(300):
        if rng.random() < 0.5:
            tokens = rng.choice([rng.randint(1, 60), rng.randint(100, 9000)])
            ok = m.admit(step, tokens)
            assert twin.admit(step, tokens) == ok
            if ok:
                live[step] = tokens
                with_runs += bool(m._entries[step].runs)
        elif rng.random() < 0.5 and live:
            rid = rng.choice(list(live))
            live[rid] += rng.randint(1, 40)
            assert m.ensure_capacity_many([(rid, live[rid])]) == twin.ensure_capacity_many(
                [(rid, live[rid])]
            )
        elif live:
            rid = rng.choice(list(live))
            del live[rid]
            assert m.block_table(rid) == twin.block_table(rid)
            twin._entries[rid].runs = None  # the block-by-block path
            m.free(rid)
            twin.free(rid)
        for a, b in zip(m._pools, twin._pools, strict=True):
            assert _state(a) == _state(b)
        m.check_invariants()
    assert with_runs, "no admission got a run: the slices went untested"
