"""One KVP group's pool of KV blocks: reference counts and a prefix cache.

A block is in exactly one of three states:

- *free*: on a stack (lowest ids on top at the start), so the same sequence
  of calls always gives the same block ids, in O(1) per block;
- *held*: referenced by one or more requests (a reference count >= 1);
- *cached*: held by nobody but still holding the KV of a full block whose
  content hash is known. It stays cached until a block is needed and no free
  one is left; then the least recently released cached block is evicted
  (its hash forgotten) and handed out.

A hash maps to at most one block of the pool. Releasing a block that is not
held, or more often than it was taken, raises AssertionError rather than
corrupting the counts. Without hashes (prefix caching off) no block is ever
cached and the pool behaves exactly as a plain free stack.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from operator import itemgetter, length_hint

_RUN = 8
"""Fewest blocks whose reference counts are set as one slice when they are a run of ids."""


class BlockPool:
    """Block ids ``0 .. num_blocks - 1`` of one group."""

    __slots__ = (
        "_block_of",
        "_cached",
        "_free",
        "_hash_of",
        "_num_held",
        "_ref",
        "group",
        "num_allocs",
        "num_blocks",
        "num_evictions",
        "num_frees",
    )

    def __init__(self, group: int, num_blocks: int) -> None:
        self.group = group
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack
        # reference count of every block (0: free or cached). A list, not a dict
        # of the held ones: a dict with this much churn is rebuilt now and then,
        # a pause of milliseconds in whichever call inserts. And not an array:
        # the interpreter reads and writes a list's items by index in its fast
        # path (about half an array's time per block in release and allocate).
        self._ref = [0] * num_blocks
        self._num_held = 0
        self._hash_of: dict[int, Hashable] = {}  # block -> content hash (held or cached)
        self._block_of: dict[Hashable, int] = {}  # content hash -> block
        self._cached: dict[int, None] = {}  # unreferenced hashed blocks, LRU first
        self.num_allocs = 0  # references handed out, ever (fresh blocks and hits)
        self.num_frees = 0  # references returned, ever
        self.num_evictions = 0  # cached blocks reused for other content, ever

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: free plus cached (evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by some request."""
        return self._num_held

    @property
    def num_cached(self) -> int:
        """Blocks held by nobody that still hold reusable KV."""
        return len(self._cached)

    def _take(self, count: int) -> list[int]:
        if count > self.num_free:
            raise AssertionError(
                f"group {self.group}: {count} blocks asked, only {self.num_free} free"
            )
        free = self._free
        fresh = min(count, len(free))
        # the top of the stack first
        keep = len(free) - fresh
        blocks = free[: keep - 1 : -1] if keep else free[::-1]
        del free[keep:]
        for _ in range(count - fresh):  # evict, least recently released first
            block = next(iter(self._cached))
            del self._cached[block]
            del self._block_of[self._hash_of.pop(block)]
            self.num_evictions += 1
            blocks.append(block)
        return blocks

    def allocate(self, owner: Hashable, count: int) -> tuple[int, ...]:
        """Give ``count`` blocks to ``owner``: free ones (most recently freed
        first), then evicted cached ones."""
        if count == 0:
            return ()
        blocks = self._take(count)
        ref = self._ref
        # The blocks are distinct (free stack, cached set): count of them spanning
        # count ids are a run. A run comes back as it went (release pushes it
        # reversed): its ends are its first and last block.
        if (
            count >= _RUN
            and abs(blocks[-1] - blocks[0]) == count - 1
            and (hi := max(blocks)) - (lo := min(blocks)) == count - 1
        ):
            ref[lo : hi + 1] = [1] * count
        else:
            for block in blocks:
                ref[block] = 1
        self._num_held += count
        self.num_allocs += count
        return tuple(blocks)

    def _drop_run(self, blocks: list[int], lo: int) -> None:
        """Release ``blocks``, the ids ``lo`` to ``lo + len - 1`` in some order, each
        held once: their counts cleared as a slice, then :meth:`_drop_cleared`."""
        count = len(blocks)
        self._ref[lo : lo + count] = [0] * count
        self._drop_cleared(blocks)

    def _drop_cleared(self, blocks: list[int]) -> None:
        """The rest of releasing ``blocks`` (distinct, held once, counts now 0): what
        the general loop of :meth:`release` does. The hashed ones go to the cache in
        order, the others back to the stack."""
        count = len(blocks)
        self._num_held -= count
        hashed = self._hash_of
        if hashed:
            self._cached.update(dict.fromkeys(filter(hashed.__contains__, blocks)))
            self._free.extend(reversed([b for b in blocks if b not in hashed]))
        else:
            self._free.extend(reversed(blocks))
        self.num_frees += count

    def _drop_held_once(self, blocks: list[int]) -> bool:
        """:meth:`release` of ``blocks`` (ids >= 0) if each is held exactly once and
        they are distinct (the common case), checking and clearing each count in
        one pass; True if so. Otherwise the counts are put back as they were and
        False is returned (the general path decides, and raises if need be): a
        block held twice or not at all, a block listed twice (its count is
        already 0 the second time) or an id past the pool stops the pass."""
        ref = self._ref
        it = iter(blocks)
        try:
            for block in it:
                if ref[block] != 1:
                    break
                ref[block] = 0
            else:
                self._drop_cleared(blocks)
                return True
        except (IndexError, TypeError):  # an id past the pool or not an int: ``it`` stopped on it
            pass
        for block in blocks[: len(blocks) - length_hint(it) - 1]:  # those cleared
            ref[block] = 1
        return False

    def allocate_each(self, owners: Sequence[Hashable]) -> tuple[int, ...]:
        """One block for each of ``owners``, in order: the blocks that
        ``allocate(owner, 1)`` called for each owner in turn would give."""
        return self.allocate(None, len(owners))

    def release_allocated(self, owner: Hashable, blocks: list[int]) -> None:
        """:meth:`release` of ``blocks`` this pool handed out (ids in the pool, as
        :meth:`allocate` and the prefix cache give them): the same end, the
        common case (each held once, distinct) taken at once, without the
        scan for ids out of range that guards it in :meth:`release` (the
        count check still stops at a block not held once: then
        :meth:`release` decides, and raises if need be)."""
        if blocks and self._drop_held_once(blocks):
            return
        self.release(owner, blocks)

    def release(self, owner: Hashable, blocks: Iterable[int]) -> None:
        """Drop one reference to each of ``blocks``; a block nobody holds
        becomes cached if it has a hash, else free."""
        if type(blocks) is not list:
            blocks = list(blocks)  # (a list is only read)
        if not blocks:
            return
        ref = self._ref
        count, first, last = len(blocks), blocks[0], blocks[-1]
        if count >= _RUN and abs(last - first) == count - 1:
            # a run of ids, either way (a freed prefix goes back last block first):
            # each held once, the counts are cleared as a slice
            lo = first if first < last else last
            if (
                lo >= 0
                and lo + count <= self.num_blocks
                and blocks
                == list(range(first, last + 1) if first < last else range(first, last - 1, -1))
            ):
                held = ref[lo : lo + count]
                if min(held) == max(held) == 1:
                    self._drop_run(blocks, lo)
                    return
        lo = min(blocks)
        if lo >= 0 and self._drop_held_once(blocks):
            return
        hi = max(blocks)
        if lo < 0 or hi >= self.num_blocks:
            self._check_release(owner, blocks)
        counts = itemgetter(*blocks)(ref) if count > 1 else (ref[first],)
        # (distinct ids each held once were taken by _drop_held_once above)
        if len(set(blocks)) < count or min(counts) < 1:
            self._check_release(owner, blocks)
        hashed = self._hash_of
        freed = []
        for block in blocks:
            left = ref[block] - 1
            ref[block] = left
            if left:
                continue
            self._num_held -= 1
            if block in hashed:
                self._cached[block] = None
            else:
                freed.append(block)
        self._free.extend(reversed(freed))
        self.num_frees += len(blocks)

    def _check_release(self, owner: Hashable, blocks: list[int]) -> None:
        """AssertionError unless every block is held at least as often as listed."""
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block] = counts.get(block, 0) + 1
        for block, n in counts.items():
            if self.ref_count(block) < n:
                raise AssertionError(
                    f"group {self.group}: block {block} released by {owner!r} more often than held"
                )

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: Hashable) -> int | None:
        """The block holding content ``block_hash`` (held or cached), or None."""
        return self._block_of.get(block_hash)

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is held by nobody but keeps its KV."""
        return block in self._cached

    def acquire(self, block: int) -> None:
        """Take one more reference to a held or cached block (a cache hit)."""
        if block in self._cached:
            del self._cached[block]
            self._ref[block] = 1
            self._num_held += 1
        elif self.ref_count(block):
            self._ref[block] += 1
        else:
            raise AssertionError(f"group {self.group}: block {block} is free, not cached")
        self.num_allocs += 1

    def register(self, block: int, block_hash: Hashable) -> bool:
        """Record that held ``block`` now holds the full content ``block_hash``.

        Returns False (changing nothing) when another block already holds
        that content or ``block`` already has a hash: a hash names at most
        one block, and a block's content never changes once full.
        """
        if not self.ref_count(block):
            raise AssertionError(f"group {self.group}: block {block} is not held")
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def ref_count(self, block: int) -> int:
        """References to ``block`` (0 when free or cached)."""
        return self._ref[block] if 0 <= block < self.num_blocks else 0

    def hash_of(self, block: int) -> Hashable | None:
        return self._hash_of.get(block)

    def check(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        held = {b for b, n in enumerate(self._ref) if n}
        free, cached = set(self._free), self._cached.keys()
        g = self.group
        assert len(free) == len(self._free), f"group {g}: a block is free twice"
        assert not free & held and not free & cached and not held & cached, (
            f"group {g}: a block is in two of free/held/cached"
        )
        assert free | held | cached == set(range(self.num_blocks)), (
            f"group {g}: free + held + cached blocks are not exactly 0..{self.num_blocks - 1}"
        )
        assert min(self._ref, default=0) >= 0, f"group {g}: a reference count is negative"
        assert self._num_held == len(held), f"group {g}: {self._num_held} held blocks counted"
        assert all(b in self._hash_of for b in cached), f"group {g}: a cached block has no hash"
        assert not free & self._hash_of.keys(), f"group {g}: a free block keeps a hash"
        assert len(self._block_of) == len(self._hash_of), f"group {g}: hash maps disagree"
        for h, b in self._block_of.items():
            assert self._hash_of.get(b) == h, f"group {g}: hash maps disagree on block {b}"
        assert self.num_allocs - self.num_frees == sum(self._ref), (
            f"group {g}: {self.num_allocs} references taken - {self.num_frees} returned != held"
        )
