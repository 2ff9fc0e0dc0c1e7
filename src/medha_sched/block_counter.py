"""One KVP group's KV blocks as a count only, for callers that never read an id.

:class:`~medha_sched.block_pool.BlockPool` names every block, so that an
executor can address the KV and the prefix cache can share it; allocating
and releasing cost time per block. A simulator reads neither: without prefix
caching, every scheduling decision depends only on how many blocks each
group has free. :class:`BlockCounter` keeps just those counts, in O(1) per
call whatever the number of blocks, and hands out the placeholder id
:data:`NO_ID` for every block (block tables keep their lengths, so a
request's capacity is still ``len(blocks) * block_size``).

It takes the pool's calls and gives the same counts for the same sequence of
calls (``num_free``, ``num_used``, ``num_allocs``, ``num_frees``); the prefix
cache's calls find nothing (``lookup``) or refuse (``register``,
``acquire``): sharing a block needs its id. Select it with
``CacheConfig(block_ids=False)``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

NO_ID = -1
"""The id a :class:`BlockCounter` gives every block it hands out."""


class BlockCounter:
    """``num_blocks`` blocks of one group, counted, not named."""

    __slots__ = ("_num_held", "group", "num_allocs", "num_blocks", "num_evictions", "num_frees")

    def __init__(self, group: int, num_blocks: int) -> None:
        self.group = group
        self.num_blocks = num_blocks
        self._num_held = 0
        self.num_allocs = 0  # blocks handed out, ever
        self.num_frees = 0  # blocks returned, ever
        self.num_evictions = 0  # (nothing is ever cached)

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take."""
        return self.num_blocks - self._num_held

    @property
    def num_used(self) -> int:
        """Blocks held by some request."""
        return self._num_held

    @property
    def num_cached(self) -> int:
        """Always 0: a counter caches nothing."""
        return 0

    def allocate(self, owner: Hashable, count: int) -> tuple[int, ...]:
        """Give ``count`` blocks to ``owner``: ``count`` copies of :data:`NO_ID`."""
        if count > self.num_blocks - self._num_held:
            raise AssertionError(
                f"group {self.group}: {count} blocks asked, only {self.num_free} free"
            )
        self._num_held += count
        self.num_allocs += count
        return (NO_ID,) * count

    def allocate_each(self, owners: Sequence[Hashable]) -> tuple[int, ...]:
        """One block for each of ``owners``, in order."""
        return self.allocate(None, len(owners))

    def release_allocated(self, owner: Hashable, blocks: Sequence[int]) -> None:
        """Return ``blocks``, as this counter handed them out (only their number is read)."""
        count = len(blocks)
        if count > self._num_held:
            raise AssertionError(
                f"group {self.group}: {owner!r} released {count} blocks, "
                f"only {self._num_held} are held"
            )
        self._num_held -= count
        self.num_frees += count

    def release(self, owner: Hashable, blocks: Iterable[int]) -> None:
        """:meth:`release_allocated`, checking that every id is :data:`NO_ID`."""
        blocks = list(blocks)
        for block in blocks:
            if block != NO_ID:
                raise AssertionError(
                    f"group {self.group}: block {block!r} released by {owner!r} was not "
                    f"handed out by a block counter (its blocks are all {NO_ID})"
                )
        self.release_allocated(owner, blocks)

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: Hashable) -> None:
        """Nothing is cached: always None."""
        return None

    def is_cached(self, block: int) -> bool:
        return False

    def acquire(self, block: int) -> None:
        raise AssertionError(f"group {self.group}: a block counter shares no blocks (no ids)")

    def register(self, block: int, block_hash: Hashable) -> bool:
        raise AssertionError(
            f"group {self.group}: a block counter keeps no ids, so it cannot cache "
            "a prefix (use CacheConfig(block_ids=True))"
        )

    def hash_of(self, block: int) -> None:
        return None

    def check(self) -> None:
        """Raise AssertionError if the counts are inconsistent."""
        g, held = self.group, self._num_held
        assert 0 <= held <= self.num_blocks, f"group {g}: {held} of {self.num_blocks} held"
        assert self.num_allocs - self.num_frees == held, (
            f"group {g}: {self.num_allocs} blocks taken - {self.num_frees} returned != {held}"
        )
