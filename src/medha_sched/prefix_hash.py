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

A request's ``cache_salt`` (vLLM's field) seeds the chain: with a salt, block
0's parent is the salt's own 128-bit digest (BLAKE2b personalised as a salt,
so no salt can pose as a token block's digest) instead of empty, so every
block of a salted prompt differs from the unsalted one and from any other
salt's: requests share cached blocks only with requests of the same salt.

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
_SALT_PERSON = b"medha.cacheSalt"  # BLAKE2b's personalisation: at most 16 bytes


def salt_digest(salt: str | None) -> bytes:
    """The parent of a sequence's block 0: empty without a salt, else the salt's digest
    (its UTF-8 bytes, lone surrogates kept, as a JSON string may carry them)."""
    if salt is None:
        return b""
    raw = salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=_DIGEST_BYTES, person=_SALT_PERSON).digest()


def extend_token_hashes(
    hashes: list[Hashable], tokens: Sequence[int], block_size: int, *, salt: str | None = None
) -> None:
    """Append the hashes of the blocks that follow ``hashes``.

    ``tokens`` are the sequence's tokens from position
    ``len(hashes) * block_size`` on; only whole blocks are hashed (a partial
    last block is left out). ``salt`` (the request's ``cache_salt``) seeds
    block 0, so it only matters while ``hashes`` is empty. The list grows in
    place.
    """
    parent = hashes[-1] if hashes else salt_digest(salt)
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


def extend_stream_hashes(
    hashes: list[Hashable], prefix_id: Hashable, num_blocks: int, *, salt: str | None = None
) -> None:
    """Append hashes of blocks ``len(hashes) .. num_blocks - 1`` of stream ``prefix_id``
    (``salt`` seeds block 0, as for token hashes)."""
    parent = hashes[-1] if hashes else (None if salt is None else ("salt", salt))
    for k in range(len(hashes), num_blocks):
        parent = hash((parent, "prefix", prefix_id, k))
        hashes.append(parent)
