"""One KVP group's pool of KV blocks, with ownership tracking.

Free block ids sit on a stack (lowest ids on top at the start), so the same
sequence of calls always gives the same block ids, in O(1) per block. Every owned
block records its owner, which makes a block owned twice or freed twice
impossible rather than merely unlikely.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


class BlockPool:
    """Block ids ``0 .. num_blocks - 1`` of one group."""

    __slots__ = ("_free", "_owner", "group", "num_allocs", "num_blocks", "num_frees")

    def __init__(self, group: int, num_blocks: int) -> None:
        self.group = group
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack
        self._owner: dict[int, Hashable] = {}
        self.num_allocs = 0  # blocks handed out, ever
        self.num_frees = 0  # blocks returned, ever

    @property
    def num_free(self) -> int:
        """Blocks not owned by any request."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks owned by some request."""
        return len(self._owner)

    def allocate(self, owner: Hashable, count: int) -> tuple[int, ...]:
        """Give ``count`` free blocks to ``owner`` (most recently freed first)."""
        if count > len(self._free):
            raise AssertionError(
                f"group {self.group}: {count} blocks asked, only {len(self._free)} free"
            )
        if count == 0:
            return ()
        blocks = tuple(reversed(self._free[-count:]))
        del self._free[-count:]
        self._owner.update(dict.fromkeys(blocks, owner))
        self.num_allocs += count
        return blocks

    def allocate_each(self, owners: Sequence[Hashable]) -> tuple[int, ...]:
        """One free block for each of ``owners``, in order: the blocks that
        ``allocate(owner, 1)`` called for each owner in turn would give."""
        count = len(owners)
        if count > len(self._free):
            raise AssertionError(
                f"group {self.group}: {count} blocks asked, only {len(self._free)} free"
            )
        if count == 0:
            return ()
        blocks = tuple(reversed(self._free[-count:]))
        del self._free[-count:]
        self._owner.update(zip(blocks, owners, strict=True))
        self.num_allocs += count
        return blocks

    def release(self, owner: Hashable, blocks: Iterable[int]) -> None:
        """Return ``blocks`` to the pool; each must be owned by ``owner``."""
        owners = self._owner
        released = []
        for block in blocks:
            if owners.pop(block, _NOBODY) != owner:
                for done in released:  # undo, so the pool stays consistent
                    owners[done] = owner
                raise AssertionError(f"group {self.group}: block {block} is not owned by {owner!r}")
            released.append(block)
        self._free.extend(reversed(released))
        self.num_frees += len(released)

    def owner_of(self, block: int) -> Hashable | None:
        """The request owning ``block``, or None when it is free."""
        return self._owner.get(block)

    def check(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        free = set(self._free)
        g = self.group
        assert len(free) == len(self._free), f"group {g}: a block is free twice"
        assert not free & self._owner.keys(), f"group {g}: block both free and owned"
        assert free | self._owner.keys() == set(range(self.num_blocks)), (
            f"group {g}: free + used blocks are not exactly 0..{self.num_blocks - 1}"
        )
        assert self.num_free + self.num_used == self.num_blocks, f"group {g}: free+used!=total"
        assert self.num_allocs - self.num_frees == self.num_used, (
            f"group {g}: {self.num_allocs} allocs - {self.num_frees} frees != {self.num_used} used"
        )


_NOBODY = object()
