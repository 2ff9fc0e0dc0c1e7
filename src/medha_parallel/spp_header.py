"""The fixed-size int64 header that precedes every stream-pipeline chunk.

gloo fills an oversized receive buffer only partly and says nothing, so a
receiver must know every tensor's exact size before it posts a receive. Each
chunk therefore starts with one header of ``HEADER_WORDS`` int64 words::

    [0]  MAGIC                      [5]  num_tokens
    [1]  VERSION                    [6]  is_last (0/1)
    [2]  seq_id                     [7]  kind (free int: 0 prefill, 1 decode, ...)
    [3]  chunk_idx                  [8]  number of tensors n (0..MAX_TENSORS)
    [4]  start_pos                  [9]  HEADER_WORDS
    [10 + 9*i : 19 + 9*i]  tensor i: name (NAME_WORDS words of ASCII, NUL padded),
                           dtype code, ndim, shape padded with zeros to MAX_NDIM
    [-1] MAGIC again (a short message leaves it zero)

Tensors follow in sorted-name order, each sent ``.contiguous()``.

A :class:`MicroBatch` (the chunks of several sequences that one forward pass
runs together) travels under one header whose meta is its summary
(:meth:`MicroBatch.summary`: ``seq_id`` :data:`MICRO_BATCH_SEQ`, ``chunk_idx``
the micro-batch's index in the stream, ``start_pos`` the stream's tokens before
it, ``num_tokens`` its tokens), with its members' metas as one more tensor,
``_chunks`` (int64 ``[n, 6]``: seq_id, chunk_idx, start_pos, num_tokens,
is_last, kind per row, in batch order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

MAGIC = int.from_bytes(b"MEDHSPP1", "big")  # fits in a signed int64 (first byte < 0x80)
VERSION = 1
MAX_TENSORS = 8
MAX_NDIM = 4
NAME_WORDS = 3
MAX_NAME_BYTES = 8 * NAME_WORDS
_FIXED = 10
_PER_TENSOR = NAME_WORDS + 2 + MAX_NDIM
HEADER_WORDS = _FIXED + MAX_TENSORS * _PER_TENSOR + 1

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


class ChunkHeaderError(ValueError):
    """A header that cannot be encoded, or a received one that is malformed."""


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """Which tokens of which sequence a chunk carries.

    ``start_pos`` is the absolute position of the chunk's first token (its KV
    offset); ``is_last`` marks the chunk whose output is wanted (the end of a
    prompt, or any decode step); ``kind`` is free (0 prefill, 1 decode
    micro-batch by convention).
    """

    seq_id: int
    chunk_idx: int
    start_pos: int
    num_tokens: int
    is_last: bool = False
    kind: int = 0

    def __post_init__(self) -> None:
        ints = (self.seq_id, self.chunk_idx, self.start_pos, self.num_tokens, self.kind)
        if (
            all(type(v) is int for v in ints)
            and min(ints[1:4]) >= 0
            and min(ints) >= _I64_MIN
            and max(ints) <= _I64_MAX
        ):
            return  # the common case, checked once per chunk per stage
        for name in ("seq_id", "chunk_idx", "start_pos", "num_tokens", "kind"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ChunkHeaderError(f"ChunkMeta.{name} must be an int, got {value!r}")
        for name in ("chunk_idx", "start_pos", "num_tokens"):
            if getattr(self, name) < 0:
                raise ChunkHeaderError(f"ChunkMeta.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("seq_id", "chunk_idx", "start_pos", "num_tokens", "kind"):
            if not _I64_MIN <= getattr(self, name) <= _I64_MAX:  # a header word is int64
                raise ChunkHeaderError(
                    f"ChunkMeta.{name} must fit in int64, got {getattr(self, name)}"
                )


#: the ``seq_id`` of a micro-batch's summary header (plain chunks use ids >= 0)
MICRO_BATCH_SEQ = -1
#: the reserved tensor that carries a micro-batch's member metas
CHUNKS_TENSOR = "_chunks"


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """The chunks of several sequences that cross a stage together, in batch order.

    ``index`` is the micro-batch's position in its stream (0, 1, ...) and
    ``stream_pos`` the tokens the stream carried before it: together they let
    the receiver check that micro-batches arrive in order, as it checks each
    member sequence's chunks. Rows of the tensors follow ``chunks``.
    """

    index: int
    stream_pos: int
    chunks: tuple[ChunkMeta, ...]

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ChunkHeaderError("a MicroBatch needs at least one chunk")
        for c in self.chunks:
            if not isinstance(c, ChunkMeta) or c.seq_id < 0:
                raise ChunkHeaderError(f"MicroBatch members need seq_id >= 0, got {c!r}")
        seqs = [c.seq_id for c in self.chunks]
        if len(set(seqs)) != len(seqs):
            raise ChunkHeaderError(f"a MicroBatch holds one chunk per sequence, got seqs {seqs}")

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def summary(self) -> ChunkMeta:
        """The meta its header carries."""
        return ChunkMeta(MICRO_BATCH_SEQ, self.index, self.stream_pos, self.num_tokens)

    def chunk_words(self) -> list[int]:
        """The ``_chunks`` rows flattened: 6 ints per member (see the module docstring)."""
        words: list[int] = []
        for c in self.chunks:
            words += (c.seq_id, c.chunk_idx, c.start_pos, c.num_tokens, int(c.is_last), c.kind)
        return words

    def chunks_tensor(self) -> torch.Tensor:
        """int64 ``[n, 6]``: one row per member (see the module docstring)."""
        return torch.tensor(self.chunk_words(), dtype=torch.int64).view(len(self.chunks), 6)

    @classmethod
    def from_parts(cls, summary: ChunkMeta, rows: torch.Tensor) -> MicroBatch:
        """Rebuild a received micro-batch; ChunkHeaderError if the parts disagree."""
        if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 6:
            raise ChunkHeaderError(
                f"{CHUNKS_TENSOR} must be int64 [n, 6], got {rows.dtype} {list(rows.shape)}"
            )
        return cls.from_words(summary, rows.reshape(-1).tolist())

    @classmethod
    def from_words(cls, summary: ChunkMeta, words: Sequence[int]) -> MicroBatch:
        """:meth:`from_parts` from the ``_chunks`` rows flattened (:meth:`chunk_words`)."""
        if len(words) % 6:
            raise ChunkHeaderError(f"{CHUNKS_TENSOR}: {len(words)} words are not rows of 6")
        chunks = []
        for i in range(0, len(words), 6):
            seq, idx, pos, n, last, kind = words[i : i + 6]
            if last not in (0, 1):
                raise ChunkHeaderError(f"{CHUNKS_TENSOR}: is_last must be 0 or 1, got {last}")
            chunks.append(ChunkMeta(seq, idx, pos, n, is_last=bool(last), kind=kind))
        batch = cls(summary.chunk_idx, summary.start_pos, tuple(chunks))
        if batch.num_tokens != summary.num_tokens:
            raise ChunkHeaderError(
                f"micro-batch header announces {summary.num_tokens} tokens, its chunks "
                f"hold {batch.num_tokens}"
            )
        return batch


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor announced by a header: enough to allocate its receive buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@lru_cache(maxsize=256)
def _name_words(name: str) -> tuple[int, ...]:
    raw = name.encode("ascii", errors="strict") if name.isascii() else b""
    if not raw or len(raw) > MAX_NAME_BYTES or b"\0" in raw:
        raise ChunkHeaderError(
            f"tensor name {name!r} must be 1..{MAX_NAME_BYTES} ASCII characters without NUL"
        )
    raw = raw.ljust(MAX_NAME_BYTES, b"\0")
    return tuple(int.from_bytes(raw[8 * i : 8 * i + 8], "big") for i in range(NAME_WORDS))


@lru_cache(maxsize=256)
def _words_name(words: tuple[int, ...]) -> str:
    raw = b"".join(w.to_bytes(8, "big") for w in words if w >= 0)
    if len(raw) != MAX_NAME_BYTES:
        raise ChunkHeaderError("tensor name words are negative")
    name = raw.rstrip(b"\0")
    if not name or b"\0" in name or not name.isascii():
        raise ChunkHeaderError(f"tensor name bytes {raw!r} are not a NUL-padded ASCII name")
    return name.decode("ascii")


def tensor_spec(name: str, t: object) -> TensorSpec:
    """``t``'s spec under ``name``; ChunkHeaderError if ``t`` is not a tensor."""
    if not isinstance(t, torch.Tensor):
        raise ChunkHeaderError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
    return TensorSpec(name, t.dtype, tuple(t.shape))


def encode_header(meta: ChunkMeta, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The CPU int64 ``[HEADER_WORDS]`` header for ``meta`` and ``tensors`` (sorted by name)."""
    specs = [tensor_spec(name, tensors[name]) for name in sorted(tensors)]
    return torch.tensor(header_words(meta, specs), dtype=torch.int64)


def header_words(meta: ChunkMeta, specs: Sequence[TensorSpec]) -> list[int]:
    """:func:`encode_header` as ``HEADER_WORDS`` Python ints, for tensors described by
    ``specs`` (sorted by name; a channel that writes the words itself needs no tensor)."""
    if len(specs) > MAX_TENSORS:
        raise ChunkHeaderError(f"a chunk carries at most {MAX_TENSORS} tensors, got {len(specs)}")
    words = [
        MAGIC,
        VERSION,
        meta.seq_id,
        meta.chunk_idx,
        meta.start_pos,
        meta.num_tokens,
        int(bool(meta.is_last)),
        meta.kind,
        len(specs),
        HEADER_WORDS,
    ]
    prev = None
    for spec in specs:
        name, dtype, shape = spec.name, spec.dtype, spec.shape
        if prev is not None and name <= prev:
            raise ChunkHeaderError(f"tensor names are not sorted and unique at {name!r}")
        prev = name
        if dtype not in _DTYPE_CODE:
            raise ChunkHeaderError(f"tensor {name!r}: dtype {dtype} cannot be sent")
        if len(shape) > MAX_NDIM:
            raise ChunkHeaderError(f"tensor {name!r}: {len(shape)} dims, at most {MAX_NDIM}")
        words += [*_name_words(name), _DTYPE_CODE[dtype], len(shape), *shape]
        words += [0] * (MAX_NDIM - len(shape))
    words += [0] * (HEADER_WORDS - 1 - len(words)) + [MAGIC]
    return words


def decode_header(header: torch.Tensor) -> tuple[ChunkMeta, list[TensorSpec]]:
    """Check a received header and read the meta and tensor specs out of it."""
    if header.dtype != torch.int64 or tuple(header.shape) != (HEADER_WORDS,):
        raise ChunkHeaderError(
            f"header must be int64 [{HEADER_WORDS}], got {header.dtype} {list(header.shape)}"
        )
    return decode_header_words(header.tolist())


def decode_header_words(w: Sequence[int]) -> tuple[ChunkMeta, list[TensorSpec]]:
    """:func:`decode_header` from the header's ``HEADER_WORDS`` words as Python ints."""
    if len(w) != HEADER_WORDS:
        raise ChunkHeaderError(f"header must be {HEADER_WORDS} words, got {len(w)}")
    if w[0] != MAGIC:
        raise ChunkHeaderError(
            f"bad magic {w[0]:#x} (expected {MAGIC:#x}): not an SPP chunk header, "
            "or the sender and receiver are out of step"
        )
    if w[1] != VERSION or w[9] != HEADER_WORDS:
        raise ChunkHeaderError(
            f"header version {w[1]} / size {w[9]} words; this side speaks version "
            f"{VERSION} with {HEADER_WORDS} words"
        )
    if w[-1] != MAGIC:
        raise ChunkHeaderError("header trailer is missing: the header arrived truncated")
    n = w[8]
    if not 0 <= n <= MAX_TENSORS:
        raise ChunkHeaderError(f"header announces {n} tensors, outside 0..{MAX_TENSORS}")
    try:
        meta = ChunkMeta(
            seq_id=w[2],
            chunk_idx=w[3],
            start_pos=w[4],
            num_tokens=w[5],
            is_last=bool(w[6]),
            kind=w[7],
        )
    except ChunkHeaderError as exc:
        raise ChunkHeaderError(f"header meta is invalid: {exc}") from None
    if w[6] not in (0, 1):
        raise ChunkHeaderError(f"header is_last must be 0 or 1, got {w[6]}")
    specs: list[TensorSpec] = []
    for i in range(n):
        base = _FIXED + i * _PER_TENSOR
        name = _words_name(tuple(w[base : base + NAME_WORDS]))
        code, ndim = w[base + NAME_WORDS], w[base + NAME_WORDS + 1]
        dims = w[base + NAME_WORDS + 2 : base + _PER_TENSOR]
        if not 0 <= code < len(_DTYPES):
            raise ChunkHeaderError(f"tensor {name!r}: unknown dtype code {code}")
        if not 0 <= ndim <= MAX_NDIM or any(d < 0 for d in dims) or any(dims[ndim:]):
            raise ChunkHeaderError(f"tensor {name!r}: bad shape ndim={ndim} dims={dims}")
        if specs and name <= specs[-1].name:
            raise ChunkHeaderError(f"tensor names are not sorted and unique at {name!r}")
        specs.append(TensorSpec(name, _DTYPES[code], tuple(dims[:ndim])))
    if any(w[_FIXED + n * _PER_TENSOR : -1]):
        raise ChunkHeaderError(f"header has data past its {n} announced tensors")
    return meta, specs
