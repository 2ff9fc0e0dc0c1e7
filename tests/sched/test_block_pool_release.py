"""``BlockPool.release`` checks and clears each block's count in one pass when
every block is held once (its common case), and hands anything else to the
general path with the counts put back: the pool must end exactly as the plain
reference-counted free stack would, and a refused release must change nothing.
"""

from __future__ import annotations

import random

import pytest

from medha_sched.block_pool import BlockPool


def _state(pool: BlockPool) -> tuple[list[int], list[int], int, int]:
    return list(pool._ref), list(pool._free), pool.num_used, pool.num_frees


@pytest.mark.parametrize(
    "bad",
    [
        [3, -1],  # a negative id: block 15 (held) if read as an index from the end
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, -16],  # likewise block 0, listed before
        [9, 4, 12, 7, 16],  # past the pool, after four held blocks
        [9, 4, 12, 7, 4],  # listed twice, held once: the second sees a count of 0
        [2, 5, 11, 14, 3, 8, 2],  # likewise, further on
    ],
)
def test_a_refused_release_changes_nothing_on_a_full_pool(bad: list[int]) -> None:
    pool = BlockPool(0, 16)
    pool.allocate("a", 16)  # every block held once
    before = _state(pool)
    with pytest.raises(AssertionError, match="more often than held"):
        pool.release("a", bad)
    assert _state(pool) == before, "a refused release changed the pool"
    pool.check()


def test_a_block_held_twice_part_way_goes_the_general_way() -> None:
    pool = BlockPool(0, 32)
    blocks = list(pool.allocate("a", 12))
    random.Random(3).shuffle(blocks)
    pool.acquire(blocks[7])  # the pass stops here and puts back the seven before it
    pool.release("a", blocks)
    assert pool.ref_count(blocks[7]) == 1
    assert all(pool.ref_count(b) == 0 for b in blocks if b != blocks[7])
    freed = [b for b in blocks if b != blocks[7]]
    assert pool._free[-len(freed) :] == freed[::-1]
    assert pool.num_used == 1 and pool.num_frees == 12
    pool.check()


@pytest.mark.parametrize("how", ["release", "release_allocated"])
@pytest.mark.parametrize("seed", range(6))
def test_scattered_releases_match_the_plain_stack(seed: int, how: str) -> None:
    """Many scattered lists (held once, some blocks shared), as a long run frees
    them; ``release_allocated`` (a KV manager's own blocks) ends alike."""
    rng = random.Random(seed)
    n = 2000
    pool = BlockPool(0, n)
    free, ref = list(range(n - 1, -1, -1)), [0] * n  # the model
    owners: list[list[int]] = []
    for step in range(400):
        if rng.random() < 0.55 and len(free) > 64:
            count = rng.randint(1, 60)
            got = pool.allocate(step, count)
            want = [free.pop() for _ in range(count)]
            assert list(got) == want
            for b in want:
                ref[b] = 1
            owners.append(want)
            if rng.random() < 0.2:  # another reference to some of them (a cache hit)
                shared = rng.sample(want, rng.randint(1, count))
                for b in shared:
                    pool.acquire(b)
                    ref[b] += 1
                owners.append(shared)
        elif owners:
            blocks = owners.pop(rng.randrange(len(owners)))
            rng.shuffle(blocks)
            getattr(pool, how)(step, blocks)
            freed = []
            for b in blocks:
                ref[b] -= 1
                if not ref[b]:
                    freed.append(b)
            free.extend(reversed(freed))
        assert pool._ref == ref and pool._free == free
    pool.check()


def test_an_id_that_is_not_an_int_changes_nothing() -> None:
    pool = BlockPool(0, 8)
    pool.allocate("a", 4)
    before = _state(pool)
    with pytest.raises(TypeError):
        pool.release("a", [0, 1, 2.0])  # type: ignore[list-item]
    assert _state(pool) == before
    pool.check()


@pytest.mark.parametrize(
    "bad",
    [
        [9, 4, 12, 7, 4],  # listed twice, held once: the second sees a count of 0
        [2, 5, 11, 14, 3, 8, 2],  # likewise, further on
    ],
)
def test_release_allocated_refuses_alike(bad: list[int]) -> None:
    """Ids the pool handed out, released more often than held: ``release``'s
    error, nothing changed."""
    pool = BlockPool(0, 16)
    pool.allocate("a", 16)
    before = _state(pool)
    with pytest.raises(AssertionError, match="more often than held"):
        pool.release_allocated("a", bad)
    assert _state(pool) == before, "a refused release changed the pool"
    pool.check()
