"""Kernel benchmark: medha backends next to SDPA, FlashInfer and flex attention, same shapes.

First measures the device's ceilings (device-to-device copy bandwidth, bf16
matmul rate), then times merge, paged decode and chunked prefill for every
medha backend usable here (``medha/<name>``) and the competitors that are
installed: ``sdpa`` (output only, no LSE), ``flashinfer`` (called directly)
and ``flex`` (compiled ``flex_attention``, CUDA only).

Per row: median time, TFLOP/s, GB/s, and % of ceiling = roofline time /
measured time, roofline time = max(FLOPs / matmul rate, bytes / copy rate).
Byte and FLOP counts (elt = bytes per element):

- merge (T tokens, H heads, D): bytes 3*T*H*D*elt + 12*T*H, FLOPs 3*T*H*D;
- decode (B seqs of L keys): bytes B*L*2*Hkv*D*elt + 2*B*Hq*D*elt, FLOPs 4*B*Hq*D*L;
- prefill (chunk c, L keys incl. the chunk): FLOPs 4*Hq*D*[c*(L-c) + c*(c+1)/2],
  bytes L*2*Hkv*D*elt + 2*c*Hq*D*elt.

    python benchmarks/kernels.py                        # GPU defaults
    python benchmarks/kernels.py --device cpu --quick --json out.json
    python benchmarks/kernels.py --figure-chunking      # one Llama-3 layer per token vs chunk
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import medha_kernels as mk

K, M = 1024, 1024 * 1024
LOG2E = math.log2(math.e)


@dataclass
class Row:
    op: str
    shape: str
    backend: str
    time_us: float
    tflops: float
    gbps: float
    pct_ceiling: float


@dataclass
class Case:
    """One op on one shape: ``fns`` maps backend name -> a zero-argument call."""

    op: str
    shape: str
    flops: float
    bytes: float
    fns: dict[str, Callable[[], object]]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.dev = args, torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.dtype = getattr(torch, args.dtype)
        self.elt = torch.empty((), dtype=self.dtype).element_size()
        self.rows: list[Row] = []
        self.skipped: list[str] = []
        self.quiet = False  # rows are printed as they come unless a caller formats them
        self.flush = torch.empty(256 * M, dtype=torch.uint8, device=self.dev) if self.cuda else None
        if args.mem_gb is not None:
            self.budget = args.mem_gb * 2**30
        else:
            self.budget = 0.6 * torch.cuda.mem_get_info(self.dev)[0] if self.cuda else 2 * 2**30
        self.fi = _import_flashinfer() if self.cuda else None
        self.flex = _compiled_flex() if self.cuda else None
        medha = [f"medha/{b}" for b in mk.available_backends(self.dev)]
        if self.cuda and "medha/triton" in medha:  # decode replayed from a CUDA graph
            medha.append("medha/triton-graph")
        others = ["sdpa"] + ["flashinfer"] * bool(self.fi) + ["flex"] * bool(self.flex)
        if args.backends:
            self.backends = [b for b in medha + others if b in args.backends.split(",")]
        else:  # CPU: the torch reference only, on tiny shapes
            self.backends = medha + others if self.cuda else ["medha/torch"]
        self.ceilings = self.measure_ceilings()
        self.ceil_gbps, self.ceil_tflops = self.ceilings["copy_gbps"], self.ceilings["mm_tflops"]

    # ------------------------------------------------------------------ timing
    def time(self, fn: Callable[[], object]) -> float:
        """Median seconds of ``fn`` (CUDA events, L2 flushed before each run; else perf_counter)."""
        fn()  # warm-up and probe
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        slow = time.perf_counter() - t0 > 0.5
        warmup, iters = (0, 3) if slow else (self.args.warmup, self.args.iters)
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def measure_ceilings(self) -> dict[str, float]:
        """Copy GB/s (read + write) and mm TFLOP/s (CPU: also fp32, which its kernels use)."""
        if self.cuda:
            nbytes, n = (256 * M, 4096) if self.args.quick else (K * M, 8192)
        else:
            nbytes, n = (32 * M, 512) if self.args.quick else (64 * M, 512)
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.dev).fill_(1)
        dst = torch.empty_like(src)
        out = {"copy_gbps": 2 * nbytes / self.time(lambda: dst.copy_(src)) / 1e9}
        for dtype in (torch.bfloat16,) if self.cuda else (torch.bfloat16, torch.float32):
            a = torch.randn(n, n, device=self.dev).to(dtype)
            rate = 2 * n**3 / self.time(lambda a=a: torch.mm(a, a)) / 1e12
            out[f"{str(dtype)[6:].replace('bfloat', 'bf').replace('float', 'fp')}_mm_tflops"] = rate
        out["mm_tflops"] = max(v for k, v in out.items() if k.endswith("_mm_tflops"))
        return out

    # ------------------------------------------------------------------ running
    def run(self, case: Case, base: float, extra: dict[str, float] | None = None) -> None:
        """Time each selected backend; skip one whose memory (base + extra bytes) is over budget."""
        for name in self.backends:
            need = base + (extra or {}).get(name, 0)
            if need > self.budget:
                self.skip(case, name, f"needs {need / 2**30:.3g} GiB, over the budget")
                continue
            if name not in case.fns:  # e.g. SDPA has no merge
                continue
            fn = case.fns[name]
            try:
                t = self.time(fn)
            except Exception as exc:  # a competitor that cannot run this shape
                self.skip(case, name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            roof = max(case.flops / (self.ceil_tflops * 1e12), case.bytes / (self.ceil_gbps * 1e9))
            row = Row(
                case.op,
                case.shape,
                name,
                t * 1e6,
                case.flops / t / 1e12,
                case.bytes / t / 1e9,
                100 * roof / t,
            )
            self.rows.append(row)
            if not self.quiet:
                print(_fmt(row), flush=True)

    def skip(self, case_or_op: Case | str, backend: str, why: str) -> None:
        what = case_or_op if isinstance(case_or_op, str) else f"{case_or_op.op} {case_or_op.shape}"
        self.skipped.append(f"{what} {backend}: {why}")  # listed after the table

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.dev, dtype=torch.float32).to(self.dtype)

    # ------------------------------------------------------------------ ops
    def medha_fns(self, call: Callable[[str], object]) -> dict[str, Callable[[], object]]:
        return {f"medha/{b}": (lambda b=b: call(b)) for b in mk.available_backends(self.dev)}

    def merge(self, t: int, h: int, d: int) -> None:
        nbytes = 3 * t * h * d * self.elt + 12 * t * h
        shape = f"T={t} H={h} D={d}"
        if 2 * nbytes > self.budget:
            return self.skip(f"merge {shape}", "all", "over the memory budget")
        va, vb = self.rand(t, h, d), self.rand(t, h, d)
        sa, sb = (torch.randn(t, h, device=self.dev) for _ in range(2))
        fns = self.medha_fns(lambda b: mk.merge_state(va, sa, vb, sb, backend=b))
        if self.fi is not None:
            s2a, s2b = sa * LOG2E, sb * LOG2E  # FlashInfer's LSE is base 2
            fns["flashinfer"] = lambda: self.fi.merge_state(va, s2a, vb, s2b)
        self.run(Case("merge", shape, 3 * t * h * d, nbytes, fns), 2 * nbytes)

    def decode(self, b: int, ctx: int, hq: int, hkv: int, d: int) -> None:
        """B sequences of ``ctx`` keys in a shuffled paged cache, one query each."""
        blk = self.args.block_size
        cache = b * ctx * 2 * hkv * d * self.elt
        shape = f"B={b} L={ctx} Hq={hq} Hkv={hkv} D={d}"
        if cache > self.budget:
            return self.skip(f"decode {shape}", "all", f"KV {cache / 2**30:.3g} GiB over budget")
        nblocks = b * ctx // blk
        kc, vc = self.rand(nblocks, blk, hkv, d), self.rand(nblocks, blk, hkv, d)
        table = torch.randperm(nblocks, device=self.dev).to(torch.int32).view(b, -1)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=self.dev)
        cu = torch.arange(b + 1, dtype=torch.int32, device=self.dev)
        q = self.rand(b, hq, d)
        fns = {}  # planned once outside the timing, as a step plans for every layer
        for name in mk.available_backends(self.dev):
            if f"medha/{name}" not in self.backends:
                continue
            try:
                plan = mk.plan_paged_attention(
                    cu_seqlens_q=cu, kv_lens=lens, block_table=table, num_qo_heads=hq,
                    num_kv_heads=hkv, head_dim=d, block_size=blk, dtype=q.dtype, backend=name,
                )  # fmt: skip
            except ValueError as exc:  # a backend that does not run attention here
                self.skip(f"decode {shape}", f"medha/{name}", str(exc))
                continue
            fns[f"medha/{name}"] = lambda plan=plan: plan.run(q, kc, vc)
            if name == "triton" and "medha/triton-graph" in self.backends:
                fns["medha/triton-graph"] = self._graphed(lambda plan=plan: plan.run(q, kc, vc))
        dense_users = {"sdpa", "flex"} & set(self.backends)
        if dense_users and 2 * cache <= self.budget:  # SDPA and flex need contiguous [B, H, L, D]
            kd, vd = (
                c[table.long()].view(b, ctx, hkv, d).transpose(1, 2).contiguous() for c in (kc, vc)
            )
            q4 = q.view(b, hq, 1, d)
            fns["sdpa"] = lambda: F.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True)
            if self.flex is not None:
                fns["flex"] = lambda: self.flex(q4, kd, vd, enable_gqa=True, return_lse=True)
        if self.fi is not None:
            fns["flashinfer"] = self._fi_decode(q, kc, vc, table, ctx)
        flops, nbytes = 4 * b * hq * d * ctx, cache + 2 * b * hq * d * self.elt
        dense = {"sdpa": cache, "flex": cache}
        self.run(Case("decode", shape, flops, nbytes, fns), cache, dense)

    @staticmethod
    def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` captured in a CUDA graph: its replay, without the Python launch cost
        (as the runtime's decode steps run)."""
        fn()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def _fi_decode(self, q, kc, vc, table, ctx):
        """FlashInfer's own decode wrapper (tensor cores for GQA), planned outside the timing."""
        b, hq, d = q.shape
        blk, hkv = kc.shape[1], kc.shape[2]
        ws = torch.empty(128 * M, dtype=torch.uint8, device=self.dev)
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        indptr = torch.arange(b + 1, dtype=torch.int32, device=self.dev) * (ctx // blk)
        last = torch.full((b,), blk, dtype=torch.int32, device=self.dev)
        w.plan(indptr, table.reshape(-1), last, hq, hkv, d, blk, q_data_type=q.dtype,
               kv_data_type=kc.dtype, sm_scale=d**-0.5)  # fmt: skip
        return lambda: w.run(q, (kc, vc), return_lse=True)

    def prefill(self, c: int, ctx: int, hq: int, hkv: int, d: int) -> bool:
        """One chunk of ``c`` new tokens over ``ctx`` keys (the chunk's own included), causal."""
        shape = f"c={c} L={ctx} Hq={hq} Hkv={hkv} D={d}"
        kv = ctx * 2 * hkv * d * self.elt
        if 2 * kv > self.budget:
            self.skip(f"prefill {shape}", "all", "over the memory budget")
            return False
        q, k, v = self.rand(c, hq, d), self.rand(ctx, hkv, d), self.rand(ctx, hkv, d)
        fns = self.medha_fns(lambda b: mk.chunked_prefill_attention(q, k, v, backend=b))
        if {"sdpa", "flex"} & set(self.backends):
            q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
            fns["sdpa"] = self._sdpa_prefill(q4, k4, v4)
            if self.flex is not None:
                fns["flex"] = self._flex_prefill(q4, k4, v4)
        if self.fi is not None:
            fns["flashinfer"] = lambda: self.fi.single_prefill_with_kv_cache(
                q, k, v, causal=True, return_lse=True
            )
        flops = 4 * hq * d * (c * (ctx - c) + c * (c + 1) / 2)
        # the torch reference keeps an fp32 partial per 4K-key tile and one score tile
        extra = {"medha/torch": 8 * -(-ctx // 4096) * c * hq * d + 12 * c * 4096 * hq}
        nbytes = kv + 2 * c * hq * d * self.elt
        self.run(Case("prefill", shape, flops, nbytes, fns), 2 * kv, extra)
        return True

    def _sdpa_prefill(self, q4, k4, v4):
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q4.shape[2], k4.shape[2])  # the chunk is the newest keys
        return lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)

    def _flex_prefill(self, q4, k4, v4):
        from torch.nn.attention.flex_attention import create_block_mask

        off = k4.shape[2] - q4.shape[2]
        bm = create_block_mask(
            lambda b, h, qi, ki: ki <= qi + off, None, None, q4.shape[2], k4.shape[2], self.dev
        )
        return lambda: self.flex(q4, k4, v4, block_mask=bm, enable_gqa=True, return_lse=True)


def _import_flashinfer():
    try:
        import flashinfer
    except Exception:
        return None
    return flashinfer


def _compiled_flex():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    import torch._dynamo

    for knob in ("recompile_limit", "cache_size_limit"):  # one compile per shape
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    return torch.compile(flex_attention, dynamic=False)


HEADER = (
    "| op | shape | backend | time (us) | TFLOP/s | GB/s | % of ceiling |\n"
    "|---|---|---|---:|---:|---:|---:|"
)


def _fmt(r: Row) -> str:
    return (
        f"| {r.op} | {r.shape} | {r.backend} | {r.time_us:.1f} | {r.tflops:.4g} | "
        f"{r.gbps:.4g} | {r.pct_ceiling:.3g} |"
    )


def shapes(args: argparse.Namespace, cuda: bool) -> dict[str, list[tuple[int, ...]]]:
    """Per op: merge (T, H, D); decode (B, L, Hq, Hkv, D); prefill (c, L, Hq, Hkv, D)."""
    if not cuda:
        lens = [256] if args.quick else [256, 1024]
        return {
            "merge": [(t, 4, 64) for t in ([64, 256] if args.quick else [64, 256, 1024])],
            "decode": [(b, n, 8, 2, 64) for b in (1, 4) for n in lens],
            "prefill": [(c, n, 8, 2, 64) for c in (16, 64) for n in lens],
        }
    ts = [4 * K, 64 * K] if args.quick else [K, 4 * K, 16 * K, 64 * K]
    batches = [1, 16] if args.quick else [1, 8, 64]
    ctxs = [4 * K, 128 * K] if args.quick else [4 * K, 32 * K, 128 * K, M]
    chunks = [128, 2048] if args.quick else [32, 128, 512, 1024, 4096]
    return {
        "merge": [(t, 32, 128) for t in ts],
        "decode": [(b, n, 32, 8, 128) for b in batches for n in ctxs],
        "prefill": [(c, n, 32, 8, 128) for n in ctxs for c in chunks if c <= n],
    }


def figure_chunking(bench: Bench) -> None:
    """Per-token cost of one Llama-3 attention layer (32 q / 8 KV heads, D 128) vs chunk size."""
    print("\n## One Llama-3 attention layer per token vs chunk size\n")
    print("| context | chunk | backend | time (ms) | us / token | TFLOP/s | % of ceiling |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    bench.quiet = True
    if "medha/torch" in bench.backends and len(bench.backends) > 1:
        bench.backends.remove("medha/torch")  # the reference is far too slow at 1M keys
    for ctx in (128 * K, 512 * K, M):
        for c in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            start = len(bench.rows)
            bench.prefill(c, ctx, 32, 8, 128)
            for r in bench.rows[start:]:
                t_ms = r.time_us / 1e3
                print(
                    f"| {ctx} | {c} | {r.backend} | {t_ms:.3f} | {r.time_us / c:.2f} | "
                    f"{r.tflops:.1f} | {r.pct_ceiling:.1f} |"
                )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="timed runs per row (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--mem-gb", type=float, default=None, help="skip shapes needing more")
    p.add_argument("--backends", default=None, help="comma list, e.g. medha/torch,sdpa")
    p.add_argument("--ops", default="merge,decode,prefill")
    p.add_argument("--figure-chunking", action="store_true")
    p.add_argument("--json", default=None, help="also write rows and ceilings here")
    args = p.parse_args(argv)
    if args.figure_chunking and not args.device.startswith("cuda"):
        print("--figure-chunking needs a GPU (1M-key contexts); nothing to do on CPU.")
        return 0
    torch.manual_seed(0)
    bench = Bench(args)
    print(f"device: {bench.dev} ({_device_name(bench.dev)}), dtype {args.dtype}")
    print("measured ceilings: " + ", ".join(f"{k} {v:.4g}" for k, v in bench.ceilings.items()))
    print(f"memory budget {bench.budget / 2**30:.1f} GiB; backends: {', '.join(bench.backends)}\n")
    if args.figure_chunking:
        figure_chunking(bench)
    else:
        print(HEADER)
        plan = shapes(args, bench.cuda)
        for op in args.ops.split(","):
            for shape in plan[op]:
                getattr(bench, op)(*shape)
                if bench.cuda:
                    torch.cuda.empty_cache()
    if bench.skipped:
        print("\nskipped:\n" + "\n".join(f"- {s}" for s in bench.skipped))
    if args.json:
        out = {
            "device": str(bench.dev),
            "device_name": _device_name(bench.dev),
            "dtype": args.dtype,
            "ceilings": bench.ceilings,
            "rows": [asdict(r) for r in bench.rows],
            "skipped": bench.skipped,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
