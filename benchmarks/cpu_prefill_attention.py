"""One sequence's prefill-chunk attention on the CPU: the native kernel against torch's flash op.

    python benchmarks/cpu_prefill_attention.py

SmolLM2's heads (9 query, 3 KV, dim 64), fp32, one thread, a paged cache of
16-token blocks. For each (queries, keys) it plans the step twice, with the
native module's ``use_flash`` rule replaced (never, then always), and times the
native kernel and torch's ``_scaled_dot_product_flash_attention_for_cpu`` through
``medha_kernels.native.cpu_flash`` (K/V gathered from the blocks, a prefix
merged with the chunk's causal triangle), thread CPU time, and checks that the
two agree. The ratio decides ``FLASH_MIN_WORK``.
"""

from __future__ import annotations

import argparse
import time

import torch

import medha_kernels as mk
from medha_kernels.native import attention as native_attn
from medha_kernels.native import cpu_flash

HQ, HKV, D, BLOCK = 9, 3, 64, 16
SHAPES = (
    (64, 64), (256, 256), (512, 512), (256, 2048), (1024, 1024),
    (128, 4096), (512, 4096), (2048, 2048),
)  # fmt: skip


def _plan(n: int, ctx: int):
    blocks = -(-ctx // BLOCK)
    return mk.plan_paged_attention(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        kv_lens=torch.tensor([ctx], dtype=torch.int32),
        block_table=torch.arange(blocks, dtype=torch.int32).view(1, -1),
        num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BLOCK, backend="native",
    )  # fmt: skip


def _time(plan, args: tuple, reps: int) -> float:
    plan.run(*args)
    t = time.thread_time()
    for _ in range(reps):
        plan.run(*args)
    return (time.thread_time() - t) / reps


def main() -> None:
    # no options: the parser answers --help (and refuses anything else) before any work
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    print(f"{'queries':>8} {'keys':>6} {'native ms':>10} {'flash ms':>9} {'native/flash':>13}")
    for n, ctx in SHAPES:
        blocks = -(-ctx // BLOCK)
        kc, vc = torch.randn(blocks, BLOCK, HKV, D), torch.randn(blocks, BLOCK, HKV, D)
        q = torch.randn(n, HQ, D)
        native_attn.use_flash = lambda n_q, n_kv: False  # the native kernel alone
        native = _plan(n, ctx)
        native_attn.use_flash = lambda n_q, n_kv: n_q > 1  # flash for this sequence
        flash = _plan(n, ctx)
        native_attn.use_flash = cpu_flash.use_flash  # the rule back
        (o1, l1), (o2, l2) = native.run(q, kc, vc), flash.run(q, kc, vc)
        assert torch.allclose(o1, o2, atol=1e-4) and torch.allclose(l1, l2, atol=1e-4)
        reps = 5 if n * ctx > 10**6 else 50
        t_native = _time(native, (q, kc, vc), reps)
        t_flash = _time(flash, (q, kc, vc), reps)
        print(
            f"{n:>8} {ctx:>6} {1e3 * t_native:>10.2f} {1e3 * t_flash:>9.2f} "
            f"{t_native / t_flash:>12.2f}x"
        )


if __name__ == "__main__":
    main()
