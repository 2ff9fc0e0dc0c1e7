"""``BlockPool.release`` of runs of block ids with prefix caching on.

A request's blocks come back as a run, ascending or (a freed prefix, last
block first) descending, and some of them hashed. The pool's run path must
leave exactly what the one-block-at-a-time rule documented in
``BlockPool.release`` leaves: hashed blocks cached in the order given (least
recently released first), the others pushed back on the free stack in reverse,
the same counters. Checked against a small model, with ``BlockPool.check``.
"""

from __future__ import annotations

import random

import pytest

from medha_sched.block_pool import BlockPool


class CacheModel:
    """Reference counts, a free stack and an LRU of cached hashed blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, str] = {}
        self.cached: dict[int, None] = {}

    def allocate(self, count: int) -> list[int]:
        fresh = min(count, len(self.free))
        blocks = [self.free.pop() for _ in range(fresh)]
        for _ in range(count - fresh):
            block = next(iter(self.cached))
            del self.cached[block]
            del self.hash_of[block]
            blocks.append(block)
        for b in blocks:
            self.ref[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        freed = []
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b]:
                continue
            if b in self.hash_of:
                self.cached[b] = None
            else:
                freed.append(b)
        self.free.extend(reversed(freed))


@pytest.mark.parametrize("seed", range(6))
def test_hashed_runs_released_as_one_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    pool, model = BlockPool(0, 512), CacheModel(512)
    held: list[list[int]] = []
    tag = 0
    runs = 0
    for _ in range(400):
        if held and (rng.random() < 0.45 or pool.num_free < 64):
            blocks = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.7:
                blocks = blocks[::-1]  # last block first, as a freed prefix goes back
            lo, hi = min(blocks), max(blocks)
            runs += hi - lo == len(blocks) - 1 and len(blocks) >= 8
            pool.release("r", blocks)
            model.release(blocks)
        else:
            count = rng.choice([1, 3, 8, 9, 17, 40])
            got = list(pool.allocate("r", count))
            assert got == model.allocate(count)
            for b in got:  # most full blocks are hashed, some not
                if rng.random() < 0.8:
                    tag += 1
                    assert pool.register(b, f"h{tag}")
                    model.hash_of[b] = f"h{tag}"
            held.append(got)
        assert pool._free == model.free
        assert list(pool._cached) == list(model.cached)
        assert list(pool._ref) == model.ref
        pool.check()
    assert runs > 5  # the run path was taken
