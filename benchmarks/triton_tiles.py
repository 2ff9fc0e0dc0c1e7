"""Sweep the Triton attention kernels' tile shapes on a GPU and print the best per shape.

    python benchmarks/triton_tiles.py --json tiles.json            # on a CUDA device
    python benchmarks/triton_tiles.py --ops decode --graph --decode-shapes 1:4096,1:32768,8:4096
    python benchmarks/triton_tiles.py --ops decode --graph --decode-configs "64,4,3,8;32,2,2,4"

Each prefill configuration (query rows per program, keys per tile, warps, pipeline
stages) runs ``medha_kernels.chunked_prefill_attention(backend="triton")`` on
Llama-3-8B attention shapes (32 query heads, 8 KV heads, dim 128, bf16); each
decode configuration (keys per tile, warps, stages, split-KV programs per SM) runs
a planned ``plan_paged_attention(...).run`` over a shuffled paged cache. Times
are medians of ``triton.testing.do_bench`` (CUDA events). The winners go into
``_TILES_BY_ARCH`` in ``src/medha_kernels/triton/attention.py`` by hand, with
the numbers in docs/benchmarks.md. ``--quick`` runs two configurations of each
on tiny shapes (on the CPU: the Triton interpreter, where the table is not
read), to check the script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

import medha_kernels as mk
from medha_kernels.triton import attention as tri

HQ, HKV, D = 32, 8, 128


def _time(fn, cuda: bool, graph: bool = False) -> float:
    """Median seconds of ``fn`` (with ``graph``: of its replay from a CUDA graph, so
    the Python launch cost is left out, as in the runtime's decode steps)."""
    if cuda:
        import triton.testing

        if graph:
            fn()  # compile outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            fn = g.replay
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _prefill_case(c: int, ctx: int, dev, dtype):
    q = torch.randn(c, HQ, D, device=dev).to(dtype)
    k, v = (torch.randn(ctx, HKV, D, device=dev).to(dtype) for _ in range(2))
    flops = 4 * HQ * D * (c * (ctx - c) + c * (c + 1) / 2)
    return (lambda: mk.chunked_prefill_attention(q, k, v, backend="triton")), flops, None


def _decode_case(b: int, ctx: int, dev, dtype, block: int = 16):
    nblocks = b * ctx // block
    kc, vc = (torch.randn(nblocks, block, HKV, D, device=dev).to(dtype) for _ in range(2))
    table = torch.randperm(nblocks, device=dev).to(torch.int32).view(b, -1)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    cu = torch.arange(b + 1, dtype=torch.int32, device=dev)
    q = torch.randn(b, HQ, D, device=dev).to(dtype)

    def run():  # planned inside: the tile table is read when the plan is made
        plan = mk.plan_paged_attention(
            cu_seqlens_q=cu, kv_lens=lens, block_table=table, num_qo_heads=HQ,
            num_kv_heads=HKV, head_dim=D, block_size=block, dtype=dtype, backend="triton",
        )  # fmt: skip
        return lambda: plan.run(q, kc, vc)

    nbytes = 2 * b * ctx * HKV * D * kc.element_size()
    return run, 4 * b * HQ * D * ctx, nbytes


def _parse_decode_configs(text: str) -> list[dict[str, int]]:
    """``"64,4,3,8;32,2,2,4"``: BLOCK_N, warps, stages, programs per SM, per configuration."""
    keys = ("BLOCK_N", "num_warps", "num_stages", "programs_per_sm")
    cfgs = []
    for item in text.split(";"):
        values = [int(x) for x in item.split(",")]
        if len(values) != len(keys):
            raise SystemExit(f"--decode-configs: {item!r} is not BLOCK_N,warps,stages,per_sm")
        cfgs.append({"rows": 16, **dict(zip(keys, values, strict=True))})
    return cfgs


def _configs(op: str, quick: bool) -> list[dict[str, int]]:
    if op == "prefill":
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
        cfgs = [
            dict(zip(("rows", "BLOCK_N", "num_warps", "num_stages"), g, strict=True)) for g in grid
        ]
    else:
        grid = itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (2, 4, 8))
        keys = ("BLOCK_N", "num_warps", "num_stages", "programs_per_sm")
        cfgs = [{"rows": 16, **dict(zip(keys, g, strict=True))} for g in grid]
    return cfgs[:2] if quick else cfgs


def _sweep(cfgs, op, fn_or_maker, cuda, args, t_end, saved) -> list[dict]:
    """Time each configuration in ``args.repeats`` interleaved rounds: rows of
    ``{"cfg", "s"}`` (the median round) or ``{"cfg", "error"}``."""
    arch = "cuda9"
    times: list[list[float]] = [[] for _ in cfgs]
    errors: dict[int, str] = {}
    for _ in range(max(args.repeats, 1)):
        for i, cfg in enumerate(cfgs):
            if i in errors:
                continue
            if time.monotonic() > t_end:
                print(f"budget spent: {op} stops after {sum(map(len, times))} timings")
                break
            tri._TILES_BY_ARCH[arch] = {**saved, op: cfg}
            fn = fn_or_maker if op == "prefill" else fn_or_maker()
            try:
                times[i].append(_time(fn, cuda, graph=args.graph and op == "decode"))
            except Exception as exc:  # a config the compiler refuses (shared memory)
                errors[i] = f"{type(exc).__name__}: {str(exc)[:120]}"
    rows = []
    for i, cfg in enumerate(cfgs):
        if i in errors:
            rows.append({"cfg": cfg, "error": errors[i]})
        elif times[i]:
            rows.append({"cfg": cfg, "s": sorted(times[i])[len(times[i]) // 2]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument(
        "--graph",
        action="store_true",
        help="time decode configurations replayed from a CUDA graph (no launch cost)",
    )
    ap.add_argument(
        "--decode-shapes",
        default=None,
        help="decode shapes B:L,... (default 1:1048576,1:4096,16:32768,64:4096)",
    )
    ap.add_argument("--ops", default="prefill,decode", help="prefill, decode or both")
    ap.add_argument(
        "--decode-configs",
        default=None,
        help="only these decode configurations: BLOCK_N,warps,stages,per_sm;... (see --repeats)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over the configurations, interleaved; each row is the median round",
    )
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    if args.quick:
        shapes = {"prefill": [(32, 256)], "decode": [(2, 256)]}
    else:
        shapes = {
            "prefill": [(512, 32768), (2048, 131072), (32, 1048576), (128, 131072)],
            "decode": [(1, 1048576), (1, 4096), (16, 32768), (64, 4096)],
        }
    if args.decode_shapes:
        shapes["decode"] = [
            tuple(int(x) for x in item.split(":")) for item in args.decode_shapes.split(",")
        ]
    shapes = {op: cases for op, cases in shapes.items() if op in args.ops.split(",")}
    arch = "cuda9"
    saved = dict(tri._TILES_BY_ARCH.get(arch, tri._DEFAULT_TILES))
    t_end = time.monotonic() + args.budget_s
    results: dict[str, list] = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    try:
        for op, cases in shapes.items():
            for shape in cases:
                fn_or_maker, flops, nbytes = (
                    _prefill_case(*shape, dev, dtype)
                    if op == "prefill"
                    else _decode_case(*shape, dev, dtype)
                )
                cfgs = _configs(op, args.quick)
                if op == "decode" and args.decode_configs:
                    cfgs = _parse_decode_configs(args.decode_configs)
                rows = _sweep(cfgs, op, fn_or_maker, cuda, args, t_end, saved)
                for row in rows:
                    if "s" in row:
                        sec = row.pop("s")
                        row.update(us=sec * 1e6, tflops=flops / sec / 1e12)
                        if nbytes:
                            row["gbps"] = nbytes / sec / 1e9
                ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
                results.setdefault(op, []).append({"shape": shape, "rows": rows})
                print(f"== {op} {shape}: {len(ok)} configs ran, {len(rows) - len(ok)} refused")
                for r in ok[:5]:
                    extra = f" {r['gbps']:.0f} GB/s" if "gbps" in r else ""
                    print(f"   {r['us']:10.1f} us {r['tflops']:7.1f} TFLOP/s{extra}  {r['cfg']}")
                for name, table in (("default", tri._DEFAULT_TILES), ("cuda9", saved)):
                    mine = next((r for r in rows if r["cfg"] == {**table[op]}), None)
                    if mine and "us" in mine:
                        print(f"   {name} {mine['us']:.1f} us")
                if len(ok) <= 8:
                    for r in rows:
                        print(f"   {r.get('us', float('nan')):10.1f} us  {r['cfg']}")
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(results, f, indent=1)
    finally:
        tri._TILES_BY_ARCH[arch] = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
