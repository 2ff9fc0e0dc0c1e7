"""CPU paged attention, side by side: the native kernel, the torch backend, torch's own ops.

For each shape, one layer's attention is timed (median over repeats, all in
one run, interleaved) for:

- ``native``: :func:`medha_kernels.plan_paged_attention` with ``backend="native"``,
  planned once, then ``plan.run`` (what every layer of a step pays);
- ``torch``: :func:`medha_kernels.paged_attention` with ``backend="torch"``
  (a Python loop per request, ``repeat_interleave`` per GQA group, validation
  per call: the runtime's CPU path before the native backend);
- ``flash``: torch's CPU flash-attention op with LSE
  (``aten._scaled_dot_product_flash_attention_for_cpu``) over K/V gathered
  from the block table into padded ``[B, Hkv, L, D]`` tensors each call, with
  an additive mask for padding and the bottom-right causal chunk;
- ``sdpa``: plain ``F.scaled_dot_product_attention(enable_gqa=True)`` on K/V
  already contiguous (no paging, no LSE, no gather): a peer for the arithmetic.

Shapes: decode of batch 1/8/32 at KV 128..4096, and one prefill chunk of
512..2,048 tokens (first chunk, and after a 2,048-token prefix), for
SmolLM2-135M's heads (9 query, 3 KV, head dim 64) and ``tiny``'s (4, 2, 16),
fp32, block size 16, blocks shuffled in the cache.

    python benchmarks/cpu_attention_backends.py            # full table
    python benchmarks/cpu_attention_backends.py --quick    # a few shapes
    python benchmarks/cpu_attention_backends.py --threads 1 --cpu-time  # on a busy machine
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from medha_kernels import paged_attention, plan_paged_attention

BLOCK = 16
MODELS = {"smollm2-135m": (9, 3, 64), "tiny": (4, 2, 16)}
DECODE = [(b, kv) for b in (1, 8, 32) for kv in (128, 512, 1024, 4096)]
PREFILL = [(c, p) for c in (512, 1024, 2048) for p in (0, 2048)]
QUICK_DECODE = [(8, 512), (32, 1024)]
QUICK_PREFILL = [(512, 0)]
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class Case:
    """One batch: ``chunks[b]`` new tokens over ``kv_lens[b]`` keys per sequence."""

    def __init__(self, heads: tuple[int, int, int], chunks: list[int], kv_lens: list[int]):
        hq, hkv, d = heads
        self.hq, self.hkv, self.d = hq, hkv, d
        self.chunks, self.lens = chunks, kv_lens
        nblocks = [-(-n // BLOCK) for n in kv_lens]
        total = sum(nblocks)
        perm = torch.randperm(total).to(torch.int32)
        width = max(nblocks)
        self.table = torch.zeros(len(chunks), width, dtype=torch.int32)
        at = 0
        for b, n in enumerate(nblocks):
            self.table[b, :n] = perm[at : at + n]
            at += n
        self.k_cache = torch.randn(total, BLOCK, hkv, d)
        self.v_cache = torch.randn(total, BLOCK, hkv, d)
        self.q = torch.randn(sum(chunks), hq, d)
        cu = [0]
        for c in chunks:
            cu.append(cu[-1] + c)
        self.cu = torch.tensor(cu, dtype=torch.int32)
        self.kv = torch.tensor(kv_lens, dtype=torch.int32)
        # contiguous copies for the plain-SDPA peer
        self.dense_k, self.dense_v = self._gather()
        self.mask = self._mask()

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V padded to ``[B, Hkv, L, D]`` from the block table."""
        width = self.table.shape[1]
        ids = self.table.long()
        k = self.k_cache[ids].reshape(len(self.lens), width * BLOCK, self.hkv, self.d)
        v = self.v_cache[ids].reshape(len(self.lens), width * BLOCK, self.hkv, self.d)
        length = max(self.lens)
        return k[:, :length].transpose(1, 2), v[:, :length].transpose(1, 2)

    def _mask(self) -> torch.Tensor:
        """Additive ``[B, 1, C, L]``: padding keys and the bottom-right causal triangle."""
        length, c = max(self.lens), max(self.chunks)
        keys = torch.arange(length).view(1, 1, -1)
        rows = torch.arange(c).view(1, -1, 1)
        lens = self.kv.long().view(-1, 1, 1)
        last = lens - torch.tensor(self.chunks).view(-1, 1, 1) + rows  # last key each row sees
        ok = (keys <= last) & (keys < lens)
        return torch.where(ok, 0.0, float("-inf")).unsqueeze(1)

    def q_padded(self) -> torch.Tensor:
        """``[B, Hq, C, D]`` (chunks are equal within a case)."""
        c = max(self.chunks)
        return self.q.view(len(self.chunks), c, self.hq, self.d).transpose(1, 2)


def candidates(case: Case) -> dict[str, Callable[[], object]]:
    plan = plan_paged_attention(
        cu_seqlens_q=case.cu,
        kv_lens=case.kv,
        block_table=case.table,
        num_qo_heads=case.hq,
        num_kv_heads=case.hkv,
        head_dim=case.d,
        block_size=BLOCK,
        backend="native",
    )
    meta = {"cu_seqlens_q": case.cu, "kv_lens": case.kv, "block_table": case.table}

    def flash():
        k, v = case._gather()
        return FLASH(case.q_padded(), k, v, attn_mask=case.mask)

    def sdpa():
        return F.scaled_dot_product_attention(
            case.q_padded(), case.dense_k, case.dense_v, attn_mask=case.mask, enable_gqa=True
        )

    return {
        "native": lambda: plan.run(case.q, case.k_cache, case.v_cache),
        "torch": lambda: paged_attention(
            case.q, case.k_cache, case.v_cache, backend="torch", **meta
        ),
        "flash": flash,
        "sdpa": sdpa,
    }


def check(case: Case, fns: dict[str, Callable[[], object]]) -> None:
    """Every candidate computes the same attention (a guard on the benchmark itself)."""
    o_native, lse_native = fns["native"]()
    o_torch, lse_torch = fns["torch"]()
    o_flash, _ = fns["flash"]()
    b, c = len(case.chunks), max(case.chunks)
    flat = o_flash.transpose(1, 2).reshape(b * c, case.hq, case.d)
    for name, o in (("torch", o_torch), ("flash", flat)):
        err = (o - o_native).abs().max().item()
        assert err < 1e-3, f"{name} differs from native by {err}"
    err = (lse_torch - lse_native).abs().max().item()
    assert err < 1e-3, f"torch LSE differs from native by {err}"


def time_case(
    fns: dict[str, Callable[[], object]], budget_s: float, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds per call, candidates interleaved, within about ``budget_s``."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    deadline = time.perf_counter() + budget_s
    while True:
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
        if len(times["native"]) >= 3 and time.perf_counter() > deadline:
            break
        if len(times["native"]) >= 200:
            break
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per shape")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time instead of the wall clock: with --threads 1 "
        "it ignores the time other processes hold the core (a busy shared machine)",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decode = QUICK_DECODE if args.quick else DECODE
    prefill = QUICK_PREFILL if args.quick else PREFILL
    what = "CPU time" if args.cpu_time else "wall clock"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, block {BLOCK}, {what}"
    )
    print("times per layer call in ms (median); ratios are torch/native and flash/native")
    header = f"{'model':13} {'shape':22} {'native':>8} {'torch':>8} {'flash':>8} {'sdpa':>8}"
    print(header + f" {'torch/nat':>9} {'flash/nat':>9} {'sdpa/nat':>8}")
    for model, heads in MODELS.items():
        shapes = [("decode", b, kv, [1] * b, [kv] * b) for b, kv in decode]
        shapes += [("prefill", c, p, [c], [p + c]) for c, p in prefill]
        for kind, x, y, chunks, lens in shapes:
            case = Case(heads, chunks, lens)
            fns = candidates(case)
            check(case, fns)
            t = time_case(fns, args.budget, clock)
            label = f"{kind} b={x} kv={y}" if kind == "decode" else f"prefill c={x} pre={y}"
            ms = {k: v * 1e3 for k, v in t.items()}
            print(
                f"{model:13} {label:22} {ms['native']:8.3f} {ms['torch']:8.3f} "
                f"{ms['flash']:8.3f} {ms['sdpa']:8.3f} {t['torch'] / t['native']:9.2f} "
                f"{t['flash'] / t['native']:9.2f} {t['sdpa'] / t['native']:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
