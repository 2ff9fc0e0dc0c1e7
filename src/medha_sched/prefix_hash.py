"""Content hashes of full KV blocks, chained along a sequence.

Block ``k`` of a sequence covers positions ``[k*B, (k+1)*B)``; its hash is
the 128-bit BLAKE2b digest of ``parent + tokens`` (the tokens as
little-endian int64), where ``parent`` is block ``k-1``'s digest (empty for
the first block). Two sequences therefore give block ``k`` the same hash
only when their first ``(k+1)*B`` tokens agree: the hash names the whole
prefix, not just the block, so a hit on block ``k`` implies hits on every
block before it. A cryptographic digest, not Python's 64-bit ``hash``: a hit
hands one request another's KV, so a collision must be out of reach, also
for prompts crafted to collide (vLLM moved to SHA-256 for the same reason,
CVE-2025-25183). It costs about 0.2 µs per token here, once per request.
Stream hashes (below) hash a string, which is stable within one process,
all a simulation needs.

A simulated request has no token ids. It may instead say that its first
``prefix_tokens`` tokens are those of a shared stream ``prefix_id``; block
``k`` of such a prefix hashes ``("prefix", prefix_id, k)`` chained the same
way, so requests naming one stream share their common full blocks.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Hashable, Sequence

_DIGEST_BYTES = 16


def extend_token_hashes(hashes: list[Hashable], tokens: Sequence[int], block_size: int) -> None:
    """Append the hashes of the blocks that follow ``hashes``.

    ``tokens`` are the sequence's tokens from position
    ``len(hashes) * block_size`` on; only whole blocks are hashed (a partial
    last block is left out). The list grows in place.
    """
    parent = hashes[-1] if hashes else b""
    num_blocks = len(tokens) // block_size
    packed = array("q", tokens[: num_blocks * block_size])
    if sys.byteorder != "little":
        packed.byteswap()
    raw = packed.tobytes()
    step = block_size * packed.itemsize
    blake2b = hashlib.blake2b
    for k in range(num_blocks):
        parent = blake2b(parent + raw[k * step : (k + 1) * step], digest_size=_DIGEST_BYTES)
        parent = parent.digest()
        hashes.append(parent)


def extend_stream_hashes(hashes: list[Hashable], prefix_id: Hashable, num_blocks: int) -> None:
    """Append hashes of blocks ``len(hashes) .. num_blocks - 1`` of stream ``prefix_id``."""
    parent = hashes[-1] if hashes else None
    for k in range(len(hashes), num_blocks):
        parent = hash((parent, "prefix", prefix_id, k))
        hashes.append(parent)
