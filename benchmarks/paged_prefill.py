"""A planned step's prefill over a paged cache, with and without split keys, side by side.

One chunk of ``C`` queries over ``L`` keys (the chunk's own included) in a
shuffled paged cache, Llama-3-8B attention heads (32 query, 8 KV, dim 128),
bf16, causal. Three rows per shape, timed in one run:

- ``split``: ``plan_paged_attention(...).run``, as a runtime step runs it; a
  chunk whose query tiles would leave the device idle has its keys split over
  several programs and merged (``prefill_splits`` in
  ``src/medha_kernels/triton/attention.py``);
- ``no split``: the same with ``MAX_PREFILL_SPLITS = 1``, the launch before
  2026-11-28 (one program per query tile and KV head: 8 programs for a
  32-token chunk, each streaming every key);
- ``contiguous``: ``chunked_prefill_attention`` on contiguous K/V of the same
  shape, which the kernels stage of ``gpu_suite.py`` measures.

    python3 benchmarks/paged_prefill.py                    # on a CUDA device
    python3 benchmarks/paged_prefill.py --shapes 32:131072,512:32768 --json out.json
    TRITON_INTERPRET=1 python3 benchmarks/paged_prefill.py --quick --device cpu   # the script

Times are medians of ``triton.testing.do_bench`` (CUDA events) on a GPU, one
wall-clock run on the CPU (where they mean nothing). Each shape's split output
is also compared with the unsplit one and the contiguous kernel's (the largest
differences of ``o`` and of the LSE); past ``O_TOL`` / ``LSE_TOL`` the script
says MISMATCH and exits 1.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import medha_kernels as mk
from medha_kernels.triton import attention as tri

HQ, HKV, D, BLOCK = 32, 8, 128, 16
#: the largest differences the split may show against the other two (bf16 outputs
#: rounded once from fp32 partials against once from the whole sum; fp32 LSEs)
O_TOL, LSE_TOL = 2e-2, 1e-3
DEFAULT_SHAPES = "32:16384,32:131072,32:1048576,128:131072,512:131072,2048:131072"


def _time(fn, cuda: bool) -> float:
    """Median seconds of ``fn``."""
    fn()  # compile outside the timing
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _case(c: int, ctx: int, dev: torch.device, dtype: torch.dtype, heads: tuple[int, int, int]):
    """The runs of one shape, ``{name: fn}``, and the split plan's metadata."""
    hq, hkv, d = heads
    nblocks = -(-ctx // BLOCK)
    kc, vc = (torch.randn(nblocks, BLOCK, hkv, d, device=dev).to(dtype) for _ in range(2))
    table = torch.randperm(nblocks, device=dev).to(torch.int32).view(1, -1)
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, c], dtype=torch.int32, device=dev)
    q = torch.randn(c, hq, d, device=dev).to(dtype)

    def planned():
        plan = mk.plan_paged_attention(
            cu_seqlens_q=cu, kv_lens=lens, block_table=table, num_qo_heads=hq,
            num_kv_heads=hkv, head_dim=d, block_size=BLOCK, dtype=dtype, backend="triton",
        )  # fmt: skip
        return lambda: plan.run(q, kc, vc), plan.meta

    split, meta = planned()
    saved = tri.MAX_PREFILL_SPLITS
    tri.MAX_PREFILL_SPLITS = 1
    try:
        whole, _ = planned()
    finally:
        tri.MAX_PREFILL_SPLITS = saved
    k = kc[table[0].long()].reshape(-1, hkv, d)[:ctx]
    v = vc[table[0].long()].reshape(-1, hkv, d)[:ctx]
    contiguous = lambda: mk.chunked_prefill_attention(q, k, v, backend="triton")  # noqa: E731
    return {"split": split, "no split": whole, "contiguous": contiguous}, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="C:L,... (queries:keys)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and heads (the CPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default=None, help="cuda (the default where there is one) or cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16
    heads = (4, 1, 64) if args.quick else (HQ, HKV, D)
    shapes = [(5, 700), (33, 300)] if args.quick else [
        tuple(int(x) for x in item.split(":")) for item in args.shapes.split(",")
    ]  # fmt: skip
    rows = []
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, heads {heads}, bf16")
    print(
        "| C | L | splits | split (us) | no split (us) | contiguous (us) | no split / split "
        "| max diff o / LSE |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    bad = 0
    for c, ctx in shapes:
        fns, meta = _case(c, ctx, dev, dtype, heads)
        diff_o, diff_lse = _differences(fns)
        ok = diff_o <= O_TOL and diff_lse <= LSE_TOL
        bad += not ok
        times = {name: _time(fn, cuda) * 1e6 for name, fn in fns.items()}
        splits = tri.prefill_splits(meta, tri._tiles(heads[0] // heads[1], heads[2], dev, dtype))
        row = {"C": c, "L": ctx, "splits": splits, **{f"{k} us": v for k, v in times.items()}}
        rows.append({**row, "max_diff_o": diff_o, "max_diff_lse": diff_lse, "ok": ok})
        print(
            f"| {c} | {ctx} | {splits} | {times['split']:.1f} | {times['no split']:.1f} | "
            f"{times['contiguous']:.1f} | {times['no split'] / times['split']:.2f}x | "
            f"{diff_o:.2g} / {diff_lse:.2g} {'ok' if ok else 'MISMATCH'} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)
    return 1 if bad else 0


def _differences(fns: dict) -> tuple[float, float]:
    """The largest ``|o|`` and ``|LSE|`` differences of the split run against the others."""
    o, lse = fns["split"]()
    diff_o = diff_lse = 0.0
    for name in ("no split", "contiguous"):
        o2, lse2 = fns[name]()
        diff_o = max(diff_o, (o.float() - o2.float()).abs().max().item())
        diff_lse = max(diff_lse, (lse - lse2).abs().max().item())
    return diff_o, diff_lse


if __name__ == "__main__":
    raise SystemExit(main())
