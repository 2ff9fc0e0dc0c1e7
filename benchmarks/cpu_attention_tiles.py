"""The torch backend's key tiles on the CPU: fixed 4,096-key tiles against tiles sized to the query.

Times :func:`medha_kernels.paged_attention` (``backend="torch"``) for the
tiny model's heads (4 query heads, 2 KV heads, head dim 16, fp32, 4 layers
per step) at the shapes the convoy benchmark runs: decode rows, short
prefills and 512/1,024-token chunks of a long prompt. Each configuration
runs ``--repeats`` times; the table gives the median and the spread
(slowest / fastest).

    python benchmarks/cpu_attention_tiles.py
    python benchmarks/cpu_attention_tiles.py --quick     # small shapes, for CI
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import medha_kernels.torch_ref.attention as ref
from medha_kernels import paged_attention

BLOCK = 16
LAYERS = 4
FULL_SHAPES = [(1, 23040), (128, 8192), (256, 2048), (512, 23040), (1024, 23040)]
QUICK_SHAPES = [(1, 300), (37, 500)]


def time_shape(num_q: int, num_kv: int, repeats: int) -> list[float]:
    """Seconds per step (``LAYERS`` calls) for one chunk of ``num_q`` rows over ``num_kv`` keys."""
    total = num_kv + num_q
    blocks = -(-total // BLOCK)
    k_cache = torch.randn(blocks, BLOCK, 2, 16)
    v_cache = torch.randn(blocks, BLOCK, 2, 16)
    q = torch.randn(num_q, 4, 16)
    kw = {
        "cu_seqlens_q": torch.tensor([0, num_q], dtype=torch.int32),
        "kv_lens": torch.tensor([total], dtype=torch.int32),
        "block_table": torch.arange(blocks, dtype=torch.int32).view(1, -1),
        "backend": "torch",
    }
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            paged_attention(q, k_cache, v_cache, **kw)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small shapes, 2 repeats")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes, repeats = (QUICK_SHAPES, 2) if args.quick else (FULL_SHAPES, args.repeats)
    default = ref.SCORE_TILE, ref.MIN_KV_TILE
    variants = {"fixed 4096-key tiles": (1 << 40, ref.KV_TILE), "sized to the query": default}
    print(f"torch {torch.__version__}, {args.threads} threads, {repeats} repeats, {LAYERS} layers")
    print("| chunk | keys | tiles | key tile | median | slowest / fastest |")
    print("|---:|---:|---|---:|---:|---:|")
    try:
        for num_q, num_kv in shapes:
            for name, (budget, floor) in variants.items():
                ref.SCORE_TILE, ref.MIN_KV_TILE = budget, floor
                times = time_shape(num_q, num_kv, repeats)
                print(
                    f"| {num_q} | {num_kv} | {name} | {ref.kv_tile(num_q, 4)} | "
                    f"{statistics.median(times) * 1e3:.1f} ms | {max(times) / min(times):.2f} |"
                )
    finally:
        ref.SCORE_TILE, ref.MIN_KV_TILE = default


if __name__ == "__main__":
    main()
