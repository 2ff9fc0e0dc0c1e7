"""``BlockPool`` sets the reference counts of a run of block ids as one slice
(allocate and release): the pool must behave exactly as the plain free stack
its docstring describes, runs or not.

A small model of that stack (no prefix cache: no hashes) is driven with the
same random calls; block ids handed out, reference counts and the free stack
must agree after every call, and ``BlockPool.check`` must pass.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.block_pool import BlockPool


class StackModel:
    """The documented behaviour without hashes: a free stack and reference counts."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks

    def allocate(self, count: int) -> tuple[int, ...]:
        blocks = [self.free.pop() for _ in range(count)]
        for b in blocks:
            self.ref[b] = 1
        return tuple(blocks)

    def acquire(self, block: int) -> None:
        assert self.ref[block] >= 1
        self.ref[block] += 1

    def release(self, blocks: list[int]) -> None:
        freed = []
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                freed.append(b)
        self.free.extend(reversed(freed))


def same_state(pool: BlockPool, model: StackModel) -> None:
    assert pool._free == model.free
    assert list(pool._ref) == model.ref
    assert pool.num_used == sum(1 for n in model.ref if n)
    pool.check()


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(8, 300))
def test_runs_and_scattered_blocks_match_the_plain_stack(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    pool, model = BlockPool(0, num_blocks), StackModel(num_blocks)
    held: list[list[int]] = []  # one entry per reference taken (a block list)
    runs = scattered = 0
    if num_blocks >= 40:  # a run from the fresh stack first: every example tests the fast path
        got = pool.allocate("r", 8)
        assert got == model.allocate(8) and max(got) - min(got) == 7
        runs += 1
        held.append(list(got))
    for _ in range(120):
        op = rng.random()
        if op < 0.45 and pool.num_free:
            count = rng.randint(1, min(pool.num_free, 40))
            got = pool.allocate("r", count)
            assert got == model.allocate(count)
            if count >= 8 and max(got) - min(got) == count - 1:
                runs += 1
            held.append(list(got))
        elif op < 0.55 and held:
            blocks = rng.choice(held)
            extra = rng.sample(blocks, rng.randint(1, len(blocks)))
            for b in extra:  # a second reference (as a prefix-cache hit takes)
                pool.acquire(b)
                model.acquire(b)
            held.append(sorted(extra))
        elif held:
            blocks = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.3:
                rng.shuffle(blocks)  # scattered: the general path
                scattered += 1
            elif rng.random() < 0.2 and len(blocks) > 1:
                part = rng.randint(1, len(blocks) - 1)  # release in two calls
                pool.release("r", blocks[:part])
                model.release(blocks[:part])
                blocks = blocks[part:]
            pool.release("r", blocks)
            model.release(blocks)
        same_state(pool, model)
    if num_blocks >= 40:
        assert runs, "no run was allocated: the fast path went untested"


def test_a_run_is_set_and_cleared_as_one() -> None:
    pool = BlockPool(0, 64)
    run = pool.allocate("a", 20)
    assert run == tuple(range(20))
    assert list(pool._ref[:21]) == [1] * 20 + [0]
    pool.release("a", list(run))
    assert list(pool._ref) == [0] * 64
    assert pool._free[-20:] == list(range(19, -1, -1))  # the run comes back on top, lowest last
    assert pool.allocate("b", 20) == run
    pool.check()


def test_a_run_held_twice_in_part_keeps_the_shared_blocks() -> None:
    pool = BlockPool(0, 64)
    run = pool.allocate("a", 16)
    pool.acquire(run[3])
    pool.release("a", list(run))
    assert pool.ref_count(run[3]) == 1
    assert pool.num_used == 1 and pool.num_free == 63
    pool.check()


@pytest.mark.parametrize("twice", [False, True])
def test_releasing_a_run_not_held_raises(twice: bool) -> None:
    pool = BlockPool(0, 64)
    run = list(pool.allocate("a", 16))
    if twice:
        pool.release("a", run)
        with pytest.raises(AssertionError, match="more often than held"):
            pool.release("a", run)
    else:
        with pytest.raises(AssertionError, match="more often than held"):
            pool.release("a", list(range(16, 32)))  # never allocated
    pool.check()


@pytest.mark.parametrize(
    "bad",
    [
        [3, 1, 2, -1],  # a negative id
        [3, 1, 2, 64],  # past the pool
        [3, 1, 2, 1],  # listed twice, held once
        [3, 1, 2, 40],  # never allocated (scattered list)
        [5, 6, 7, 8, 9, 10, 11, 12, 20],  # a run, then a block not held
    ],
)
def test_scattered_release_checks_every_block(bad: list[int]) -> None:
    pool = BlockPool(0, 64)
    pool.allocate("a", 16)
    before = list(pool._ref), list(pool._free)
    with pytest.raises(AssertionError, match="more often than held"):
        pool.release("a", bad)
    assert (list(pool._ref), list(pool._free)) == before, "a refused release changed the pool"


def test_a_block_held_twice_may_be_listed_twice() -> None:
    pool = BlockPool(0, 64)
    blocks = pool.allocate("a", 4)
    pool.acquire(blocks[1])
    pool.release("a", [blocks[1], blocks[3], blocks[1], blocks[0], blocks[2]])
    assert pool.num_used == 0 and pool.num_free == 64
    pool.check()
