"""Launchers for the attention kernels (arguments already validated).

Tiling: a program owns ``BLOCK_M = max(64, next_pow2(group))`` rows, that is
``BLOCK_Q = BLOCK_M // group`` query tokens x the ``group`` query heads of one
KV head, against ``BLOCK_N``-key tiles; the head dim is padded to a power of two.

Split-KV: a decode (a sequence with one query) in :func:`paged_attention`
splits its keys into ``min(MAX_SPLITS, cdiv(kv_len, SPLIT_MIN_KV))`` chunks run
by separate programs, then merged by the N-way merge kernel.
:func:`chunked_prefill_attention` splits the same way when its query tiles
alone would leave the device idle.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton

from medha_kernels.triton._common import block_d, interpreting, rne_bf16
from medha_kernels.triton.kernels.attention import (
    chunked_prefill_kernel,
    paged_decode_kernel,
    paged_prefill_kernel,
)
from medha_kernels.triton.merge import launch_merge_states

MAX_SPLITS = 16  # most KV splits per sequence (chunked prefill; unplanned decode)
MAX_DECODE_SPLITS = 256  # most KV splits per decode in a planned step
MAX_PREFILL_SPLITS = 64  # most KV splits per query tile in a planned step's prefill launch
PREFILL_PARTIALS_BYTES = 64 << 20  # most bytes of fp32 partial states those splits hold
SPLIT_MIN_KV = 128  # fewest keys worth a split of their own
_LOG2E = 1.0 / math.log(2.0)


# Tile shapes and launch options by op. ``rows`` is the smallest BLOCK_M (query
# rows = tokens x the GQA group); "cuda9" holds Hopper's, measured on an H100
# with benchmarks/triton_tiles.py (docs/benchmarks.md, issue 22).
_DEFAULT_TILES = {
    "prefill": {"rows": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    "decode": {"rows": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2},
}
_TILES_BY_ARCH: dict[str, dict[str, dict[str, int]]] = {
    # bf16, 32/8 heads of dim 128. Prefill (H100): within 0.8% of the best of 36
    # tile shapes on 4 chunk/context shapes. Decode (H200, replayed from a CUDA
    # graph, 8 configurations x 7 batch/context shapes, median of 5 rounds):
    # within 13% of each shape's best, where 3 pipeline stages were up to 30% off
    "cuda9": {
        "prefill": {"rows": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
        "decode": {
            "rows": 16,
            "BLOCK_N": 64,
            "num_warps": 4,
            "num_stages": 2,
            "programs_per_sm": 8,
        },
    },
}


def tile_config(op: str, device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """The tile table entry for ``op`` (``"prefill"`` or ``"decode"``) on ``device``.

    The per-arch tiles are sized for 16-bit inputs; fp32 (twice the shared
    memory per tile) keeps the defaults.
    """
    if device.type == "cuda" and dtype.itemsize <= 2:
        return _TILES_BY_ARCH.get(_arch(device), _DEFAULT_TILES)[op]
    return _DEFAULT_TILES[op]


@functools.cache
def _arch(device: torch.device) -> str:
    """``"cuda<major>"`` of a CUDA device (read once per device: launches ask per layer)."""
    return f"cuda{torch.cuda.get_device_capability(device)[0]}"


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tiles(
    group: int, head_dim: int, device: torch.device, dtype: torch.dtype, op: str = "prefill"
) -> dict:
    cfg = tile_config(op, device, dtype)
    bd = block_d(head_dim)
    bm = max(cfg["rows"], triton.next_power_of_2(group))
    return {
        "BLOCK_M": bm,
        "BLOCK_Q": bm // group,
        "BLOCK_N": cfg["BLOCK_N"] if bd <= 128 else 32,
        "BLOCK_D": bd,
    }


def _flags(dtype: torch.dtype) -> dict:
    interp = interpreting()
    return {
        "UPCAST": interp and dtype != torch.float32,
        # fp32 inputs (and interpreter upcasts) get true fp32 dots, not TF32.
        "DOT_PREC": "ieee" if interp or dtype == torch.float32 else "tf32",
    }


def _launch_opts(device: torch.device, dtype: torch.dtype, op: str = "prefill") -> dict:
    if interpreting():
        return {}
    cfg = tile_config(op, device, dtype)
    return {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def _target_programs(device: torch.device, per_sm: int = 2) -> int:
    if device.type == "cuda":
        return per_sm * _sm_count(device)
    return 64


def num_kv_splits(num_kv: int, programs: int, target: int, cap: int = MAX_SPLITS) -> int:
    """KV splits for a launch with ``programs`` (query tile, KV head) programs (at most ``cap``)."""
    if programs >= target:
        return 1
    return max(1, min(cap, triton.cdiv(num_kv, SPLIT_MIN_KV), triton.cdiv(target, programs)))


def decode_splits(max_kv: int, programs: int, device: torch.device, dtype: torch.dtype) -> int:
    """Split-KV programs per decode: enough for ``programs_per_sm`` per SM in all.

    ``programs`` is decodes x KV heads; each split keeps at least
    ``SPLIT_MIN_KV`` keys, and there are at most ``MAX_DECODE_SPLITS``.
    """
    target = _target_programs(device, tile_config("decode", device, dtype)["programs_per_sm"])
    return num_kv_splits(max_kv, max(programs, 1), target, MAX_DECODE_SPLITS)


def prefill_splits(meta, tiles: dict) -> int:
    """KV splits for a planned step's prefill launch (1: none).

    A short chunk over a long context has few query tiles: one per KV head for
    a 32-token chunk, so 8 programs on a whole GPU, each streaming every key of
    the context. When the tiles would fill less than half the device, each gets
    ``num_kv_splits`` splits of its keys (at most ``MAX_PREFILL_SPLITS``),
    merged after; the fp32 partials of every query row (``[num_q, splits, H,
    D]`` and their LSEs) stay within ``PREFILL_PARTIALS_BYTES``.
    """
    counts, lens = meta.query_counts, meta.lens
    prefills = [(n, n_kv) for n, n_kv in zip(counts, lens, strict=True) if n > 1]
    if not prefills:
        return 1
    programs = sum(triton.cdiv(n, tiles["BLOCK_Q"]) for n, _ in prefills) * meta.num_kv_heads
    target = _target_programs(meta.device)
    if 2 * programs > target:  # a split or two would buy little and cost a merge
        return 1
    longest = max(n_kv for _, n_kv in prefills)
    splits = num_kv_splits(longest, programs, target, MAX_PREFILL_SPLITS)
    per_split = max(meta.num_q * meta.num_qo_heads * (meta.head_dim + 1) * 4, 1)
    return max(1, min(splits, PREFILL_PARTIALS_BYTES // per_split))


def _split_outputs(
    out: torch.Tensor, lse: torch.Tensor, splits: int, *, empty: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """Where a prefill launch of ``splits`` KV splits writes, and its strides.

    One split: ``out`` ``[T, H, D]`` / ``lse`` ``[T, H]`` themselves, with a split
    stride of 0. Several: fp32 partials ``[T, splits, H, D]`` / ``[T, splits, H]``
    for :func:`launch_merge_states`; with ``empty`` their LSEs start at -inf, so
    rows no program writes merge to the empty state.
    """
    if splits == 1:
        o_strides = (out.stride(0), 0, out.stride(1), out.stride(2))
        return out, lse, o_strides, (lse.stride(0), 0, lse.stride(1))
    num_q, num_heads, head_dim = out.shape
    o_dst = torch.empty(
        (num_q, splits, num_heads, head_dim), dtype=torch.float32, device=out.device
    )
    lse_dst = torch.empty((num_q, splits, num_heads), dtype=torch.float32, device=out.device)
    if empty:
        lse_dst.fill_(float("-inf"))
    return o_dst, lse_dst, o_dst.stride(), lse_dst.stride()


def chunked_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.chunked_prefill_attention`."""
    num_q, num_heads, head_dim = q.shape
    num_kv, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((num_q, num_heads), dtype=torch.float32, device=q.device)
    if num_q == 0 or num_heads == 0:
        return out, lse
    tiles = _tiles(group, head_dim, q.device, q.dtype)
    q_tiles = triton.cdiv(num_q, tiles["BLOCK_Q"])
    splits = num_kv_splits(num_kv, q_tiles * num_kv_heads, _target_programs(q.device))
    o_dst, lse_dst, o_strides, lse_strides = _split_outputs(out, lse, splits, empty=False)
    chunked_prefill_kernel[(q_tiles, num_kv_heads, splits)](
        q,
        k,
        v,
        o_dst,
        lse_dst,
        num_q,
        num_kv,
        q_offset,
        sm_scale * _LOG2E,
        head_dim,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *o_strides,
        *lse_strides,
        GROUP=group,
        EVEN_D=head_dim == block_d(head_dim),
        CAUSAL=causal,
        RNE_BF16=splits == 1 and rne_bf16(q.dtype),
        **_flags(q.dtype),
        **tiles,
        **_launch_opts(q.device, q.dtype),
    )
    if splits > 1:
        launch_merge_states(o_dst, lse_dst, out, lse)
    return out, lse


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`medha_kernels.paged_attention`.

    Two launches plus a merge: query tiles of sequences with several queries
    (prefill chunks), and split-KV programs for single-query sequences (decodes)
    whose partials the N-way merge kernel reduces into their output rows.
    Unplanned, it cannot read the batch on the host, so it launches both with
    ``MAX_SPLITS`` splits; :func:`plan_paged_attention` sizes them to the step.
    """
    return _paged(
        q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_table, causal, sm_scale,
        prefill=True, splits=MAX_SPLITS,
    )  # fmt: skip


def plan_paged_attention(meta) -> Callable:
    """Plan a step (a :class:`medha_kernels.plan.PagedMeta`) once for every layer.

    From the host copies of the batch it decides whether any sequence has
    several queries (else the prefill launch is left out) and how many KV
    splits its decodes get (:func:`decode_splits`: none when there is no decode).
    """
    counts = meta.query_counts
    prefill = any(n > 1 for n in counts)
    decode_lens = [n_kv for n, n_kv in zip(counts, meta.lens, strict=True) if n == 1]
    splits = 0
    if decode_lens:
        programs = len(decode_lens) * meta.num_kv_heads
        splits = decode_splits(max(decode_lens), programs, meta.device, meta.dtype)
    group = meta.num_qo_heads // meta.num_kv_heads
    psplits = 1
    if prefill:
        psplits = prefill_splits(meta, _tiles(group, meta.head_dim, meta.device, meta.dtype))
    cu, lens, table = meta.cu_seqlens_q, meta.kv_lens, meta.block_table
    causal, scale = meta.causal, meta.sm_scale

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        return _paged(
            q, k_cache, v_cache, cu, lens, table, causal, scale,
            prefill=prefill, splits=splits, prefill_splits=psplits,
        )  # fmt: skip

    return run


def _paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool,
    sm_scale: float,
    *,
    prefill: bool,
    splits: int,
    prefill_splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill launch if ``prefill`` (``prefill_splits`` KV splits per query tile,
    merged), the split-KV decode launch and merge if ``splits``."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch = kv_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((num_q, num_heads), dtype=torch.float32, device=q.device)
    if num_q == 0 or num_heads == 0 or batch == 0:
        return out, lse
    cu = cu_seqlens_q.contiguous()
    lens = kv_lens.contiguous()
    flags = _flags(q.dtype)
    strides = (
        *block_table.stride(),
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
    )
    bd = block_d(head_dim)
    if prefill:
        _paged_prefill(
            q, k_cache, v_cache, out, lse, cu, lens, block_table, causal, sm_scale,
            strides, prefill_splits,
        )  # fmt: skip
    if splits == 0:
        return out, lse
    dtiles = _tiles(group, head_dim, q.device, q.dtype, "decode")
    o_part = torch.empty((batch, splits, num_heads, head_dim), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((batch, splits, num_heads), dtype=torch.float32, device=q.device)
    paged_decode_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        o_part,
        lse_part,
        cu,
        lens,
        block_table,
        k_cache.shape[1],
        sm_scale * _LOG2E,
        head_dim,
        *strides,
        *o_part.stride(),
        *lse_part.stride(),
        GROUP=group,
        EVEN_D=head_dim == bd,
        SPLIT_MIN_KV=SPLIT_MIN_KV,
        BLOCK_M=dtiles["BLOCK_M"],
        BLOCK_N=dtiles["BLOCK_N"],
        BLOCK_D=bd,
        **flags,
        **_launch_opts(q.device, q.dtype, "decode"),
    )
    launch_merge_states(o_part, lse_part, out, lse, cu_seqlens=cu)
    return out, lse


def _paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    lens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool,
    sm_scale: float,
    strides: tuple[int, ...],
    splits: int,
) -> None:
    """The query tiles of the sequences with several queries, into ``out`` / ``lse``.

    With ``splits > 1`` each tile's keys are split: fp32 partials ``[num_q, splits,
    H, D]`` / ``[num_q, splits, H]`` merged into ``out`` / ``lse``. Their LSEs start
    at -inf, so the rows no tile writes (decodes, which the decode launch writes
    after) merge to the empty state.
    """
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch = lens.shape[0]
    tiles = _tiles(group, head_dim, q.device, q.dtype)
    o_dst, lse_dst, o_strides, lse_strides = _split_outputs(out, lse, splits, empty=True)
    paged_prefill_kernel[(num_q // tiles["BLOCK_Q"] + batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        o_dst,
        lse_dst,
        cu,
        lens,
        block_table,
        batch,
        k_cache.shape[1],
        sm_scale * _LOG2E,
        head_dim,
        *strides,
        *o_strides,
        *lse_strides,
        GROUP=group,
        EVEN_D=head_dim == block_d(head_dim),
        CAUSAL=causal,
        SKIP_DECODE=True,
        RNE_BF16=splits == 1 and rne_bf16(q.dtype),
        **_flags(q.dtype),
        **tiles,
        **_launch_opts(q.device, q.dtype),
    )
    if splits > 1:
        launch_merge_states(o_dst, lse_dst, out, lse)
