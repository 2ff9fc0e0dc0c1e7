"""What a decode attention call costs three ways: a plan's ``run``, the function, the custom op.

One decode step's attention at SmolLM2-135M's heads (9 query, 3 KV heads of
64): ``--batch`` sequences of ``--context`` cached tokens in a shuffled paged
cache of 16-token blocks, fp32 on the CPU, one thread. Times, side by side
in one run (medians of ``--iters`` calls, rotating the order):

- ``plan.run``: :func:`medha_kernels.plan_paged_attention` once, then
  ``run`` per call (what ``medha_runtime`` does in every layer);
- ``function``: :func:`medha_kernels.paged_attention` (validates and plans per call);
- ``torch.ops.medha``: the custom op of :mod:`medha_kernels.library`
  (the function behind the dispatcher).

    python benchmarks/custom_op_overhead.py --batch 1 8 --context 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import medha_kernels
from medha_kernels import library  # noqa: F401  (registers torch.ops.medha)


def inputs(batch: int, context: int, block: int = 16) -> dict[str, torch.Tensor]:
    """A decode batch: ``q [batch, 9, 64]`` fp32 over a shuffled paged cache."""
    per = -(-context // block)
    table = torch.randperm(batch * per, dtype=torch.int32).view(batch, per)
    return {
        "q": torch.randn(batch, 9, 64),
        "k_cache": torch.randn(batch * per, block, 3, 64),
        "v_cache": torch.randn(batch * per, block, 3, 64),
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32),
        "kv_lens": torch.full((batch,), context, dtype=torch.int32),
        "block_table": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for batch in args.batch:
        x = inputs(batch, args.context)
        meta = {k: x[k] for k in ("cu_seqlens_q", "kv_lens", "block_table")}
        plan = medha_kernels.plan_paged_attention(
            **meta,
            num_qo_heads=9,
            num_kv_heads=3,
            head_dim=64,
            block_size=16,
            dtype=torch.float32,
            backend=args.backend,
        )
        calls = {
            "plan.run": lambda x=x, plan=plan: plan.run(x["q"], x["k_cache"], x["v_cache"]),
            "function": lambda x=x, meta=meta: medha_kernels.paged_attention(
                x["q"], x["k_cache"], x["v_cache"], **meta, backend=args.backend
            ),
            "torch.ops.medha": lambda x=x: torch.ops.medha.paged_attention(
                *x.values(), True, None, args.backend
            ),
        }
        outs = {name: fn() for name, fn in calls.items()}
        base = outs["plan.run"]
        same = all(torch.equal(o[0], base[0]) and torch.equal(o[1], base[1]) for o in outs.values())
        times: dict[str, list[float]] = {name: [] for name in calls}
        names = list(calls)
        for i in range(args.iters):
            for name in names[i % 3 :] + names[: i % 3]:
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
        print(
            f"batch {batch}, context {args.context}, backend {plan.backend}: "
            + ", ".join(f"{n} {m:.1f} us" for n, m in med.items())
            + f"; op over plan.run {med['torch.ops.medha'] / med['plan.run']:.2f}x, "
            f"identical outputs: {same}"
        )


if __name__ == "__main__":
    main()
