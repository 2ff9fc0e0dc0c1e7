"""Dequantizing GGUF tensor rows (llama.cpp's GGML block formats) to torch.

A GGUF matrix of shape ``[rows, cols]`` (torch order; the file writes it
``[cols, rows]``) is stored row by row, each row a run of blocks of
``block_size`` values along ``cols``. Rows are therefore independent: a TP rank
reads and dequantizes only its own rows, and a column range that falls on
block boundaries is read as whole blocks.

Formats decoded here in torch (vectorized, exactly llama.cpp's arithmetic in
fp32: bit-identical to ``gguf.quants.dequantize``):

- ``F32``, ``F16``, ``BF16``: plain values;
- ``Q8_0``: blocks of 32 int8 ``q`` with an fp16 scale ``d``: ``d * q``;
- ``Q4_0``: blocks of 32 4-bit ``q`` (low nibbles are values 0-15, high
  nibbles 16-31) with ``d``: ``d * (q - 8)``;
- ``Q4_1``: as Q4_0 with a minimum ``m`` and no offset: ``d * q + m``.

The K-quants and 5-bit formats of common ``Q4_K_M``-style files (``Q5_0``,
``Q5_1``, ``Q2_K`` ... ``Q6_K``) go through the ``gguf`` package's NumPy
reference decoder. Any other type is refused by name
(:func:`check_supported`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

#: decoded by the gguf package's reference implementation (NumPy)
REFERENCE_TYPES = (Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def decode(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.view(dtype).float()

    return decode


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as fp32 ``[num_blocks, 1]``."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, 16]`` uint8 → ``[num_blocks, 32]`` fp32: low nibbles, then high."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _scale(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _scale(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _scale(blocks, 0) * _nibbles(blocks[:, 4:]) + _scale(blocks, 2)


#: torch decoders: ``[num_blocks, type_size]`` uint8 → ``[num_blocks, block_size]`` fp32
TORCH_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _plain(torch.float32),
    Q.F16: _plain(torch.float16),
    Q.BF16: _plain(torch.bfloat16),
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
}

SUPPORTED_TYPES = (*TORCH_DECODERS, *REFERENCE_TYPES)


def type_name(ggml_type: int) -> str:
    """``"Q4_1"`` for a known type number, else ``"type 99"``."""
    try:
        return Q(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def check_supported(ggml_type: int) -> str | None:
    """None if rows of this type can be dequantized, else why not (naming the type)."""
    if ggml_type in SUPPORTED_TYPES:
        return None
    names = ", ".join(t.name for t in SUPPORTED_TYPES)
    return f"tensor type {type_name(ggml_type)} is not supported (supported: {names})"


def block_shape(ggml_type: int) -> tuple[int, int]:
    """``(values per block, bytes per block)``."""
    return GGML_QUANT_SIZES[Q(ggml_type)]


def dequantize_rows(raw: np.ndarray, ggml_type: int, cols: int) -> torch.Tensor:
    """Decode whole rows.

    Args:
        raw: ``[rows, row_bytes]`` uint8, each row ``cols / block_size`` blocks
            (a NumPy view of the file; only these bytes are copied).
        ggml_type: the tensor's GGML type (one of :data:`SUPPORTED_TYPES`).
        cols: values per row.

    Returns:
        ``[rows, cols]`` float32.
    """
    qtype = Q(ggml_type)
    rows = raw.shape[0]
    if qtype in TORCH_DECODERS:
        values, size = GGML_QUANT_SIZES[qtype]
        blocks = torch.from_numpy(np.array(raw, order="C", copy=True).reshape(-1, size))
        out = TORCH_DECODERS[qtype](blocks)
        return out.reshape(rows, cols)
    from gguf.quants import dequantize

    values = dequantize(np.array(raw, order="C", copy=True), qtype)
    return torch.from_numpy(values).float().reshape(rows, cols)
