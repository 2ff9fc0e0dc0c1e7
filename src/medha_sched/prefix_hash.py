"""Content hashes of full KV blocks, chained along a sequence.

Block ``k`` of a sequence covers positions ``[k*B, (k+1)*B)``; its hash is
``hash((parent, tokens))`` where ``parent`` is block ``k-1``'s hash (``None``
for the first block). Two sequences therefore give block ``k`` the same hash
only when their first ``(k+1)*B`` tokens agree: the hash names the whole
prefix, not just the block, so a hit on block ``k`` implies hits on every
block before it. Python's hash of a tuple of ints is deterministic across
processes (no string hashing is involved); stream hashes (below) hash a
string, which is stable within one process, all a simulation needs.

A simulated request has no token ids. It may instead say that its first
``prefix_tokens`` tokens are those of a shared stream ``prefix_id``; block
``k`` of such a prefix hashes ``("prefix", prefix_id, k)`` chained the same
way, so requests naming one stream share their common full blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def extend_token_hashes(hashes: list[Hashable], tokens: Sequence[int], block_size: int) -> None:
    """Append the hashes of the blocks that follow ``hashes``.

    ``tokens`` are the sequence's tokens from position
    ``len(hashes) * block_size`` on; only whole blocks are hashed (a partial
    last block is left out). The list grows in place.
    """
    parent = hashes[-1] if hashes else None
    for k in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[k * block_size : (k + 1) * block_size])))
        hashes.append(parent)


def extend_stream_hashes(hashes: list[Hashable], prefix_id: Hashable, num_blocks: int) -> None:
    """Append hashes of blocks ``len(hashes) .. num_blocks - 1`` of stream ``prefix_id``."""
    parent = hashes[-1] if hashes else None
    for k in range(len(hashes), num_blocks):
        parent = hash((parent, "prefix", prefix_id, k))
        hashes.append(parent)
