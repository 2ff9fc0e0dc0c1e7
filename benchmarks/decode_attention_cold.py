"""Decode attention with the KV cold, as in a model's step: one cache per layer, weights between.

In a decode step at batch 32 on SmolLM2-135M's shape (30 layers, 9 query / 3
KV heads of 64, blocks of 16), each layer's KV (32 x 80 keys x 768 B x 2 =
3.9 MB) was last read one step earlier; the ~540 MB of weights streamed since
then evicted it, so the attention reads it from memory. This times
``PagedAttentionPlan.run`` (fp32, causal, one plan, one decode token per
sequence over ``--context`` keys in shuffled blocks) over ``--layers``
distinct caches, summing ``--evict-mb`` MB of a buffer (a layer's MLP weights:
about 10.6 MB, plus its QKV and output projections: 14 MB) before each layer
and leaving that out of the time. ``--evict-mb 0 --layers 1`` gives the kernel
with its KV hot in L2. Prints the median and minimum of the per-step sums.

To compare with an older tree, run it with ``PYTHONPATH=<that tree>/src``.

    python benchmarks/decode_attention_cold.py --batch 32 --context 80
    python benchmarks/decode_attention_cold.py --batch 1 --context 32768 --layers 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import medha_kernels
from medha_kernels import plan_paged_attention

BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=80, help="keys per sequence")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--evict-mb", type=float, default=14.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--backend", default="native")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, hq, hkv, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    per_seq = -(-args.context // BLOCK)
    ids = list(range(b * per_seq))
    random.Random(0).shuffle(ids)
    table = torch.tensor(
        [ids[i * per_seq : (i + 1) * per_seq] for i in range(b)], dtype=torch.int32
    )
    torch.manual_seed(0)
    caches = [
        (torch.randn(b * per_seq, BLOCK, hkv, d), torch.randn(b * per_seq, BLOCK, hkv, d))
        for _ in range(args.layers)
    ]
    q = torch.randn(b, hq, d)
    evict = torch.randn(int(args.evict_mb * 2**20 / 4)) if args.evict_mb > 0 else None
    plan = plan_paged_attention(
        cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
        kv_lens=torch.full((b,), args.context, dtype=torch.int32),
        block_table=table,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=BLOCK,
        dtype=torch.float32,
        causal=True,
        sm_scale=d**-0.5,
        backend=args.backend,
    )
    steps = []
    for _ in range(args.steps + 2):
        total = 0.0
        for k, v in caches:
            if evict is not None:
                evict.sum()
            t0 = time.perf_counter()
            plan.run(q, k, v)
            total += time.perf_counter() - t0
        steps.append(total)
    steps = steps[2:]
    kv_mb = 2 * b * args.context * hkv * d * 4 / 2**20
    print(
        f"medha_kernels from {medha_kernels.__file__}\n"
        f"decode attention, batch {b}, context {args.context}, {args.layers} layers "
        f"({kv_mb:.1f} MB of KV each), evict {args.evict_mb} MB, {args.threads} threads, "
        f"backend {args.backend}: median {statistics.median(steps) * 1e3:.2f} ms, "
        f"min {min(steps) * 1e3:.2f} ms per step ({min(steps) / args.layers * 1e6:.0f} us "
        f"a layer at the min)"
    )


if __name__ == "__main__":
    main()
