"""Decode-sized products on the CPU: the native small-M linear kernels against ``F.linear``.

    python benchmarks/cpu_linear.py --rows 1 8 16 24 32 48 64

SmolLM2-135M's weights, fp32, one thread: 30 layers of distinct random
matrices (q, k, v, o, gate, up, down: ``[576, 576]``, ``[192, 576]`` x 2,
``[576, 576]``, ``[1536, 576]`` x 2, ``[576, 1536]``) plus the ``[49152, 576]``
LM head, 538 MB in all, so every pass streams the weights from memory as a
decode step does. For each row count M, one pass multiplies an ``[M, K]`` input
by every matrix; the native module's ``linear_small_m`` (called directly, so
also above the row limit ``medha_kernels.linear`` applies) and ``F.linear``
alternate, pass by pass, and the best of ``--reps`` passes counts (thread CPU
time). Printed per M: ms per pass, GF/s (2 M N K per matrix), the weight read
bandwidth (bytes of weights / time), native/F.linear, and which one
``medha_kernels.linear.linear`` picks at that M on this build.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch
import torch.nn.functional as F

from medha_kernels import native

LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 24, 32, 48, 64])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = native.get_module("cpu")
    limit = importlib.import_module("medha_kernels.linear").native_row_limit()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for _ in range(args.layers) for n, k in LAYER]
    weights.append(torch.randn(*HEAD, generator=gen))
    params = sum(w.numel() for w in weights)
    print(
        f"isa={module.linear_small_m_isa!r} row limit={limit} threads={args.threads} "
        f"weights={params * 4 / 1e6:.0f} MB"
    )
    print(
        f"{'M':>3} {'native ms':>10} {'F ms':>8} {'native GF/s':>12} {'F GF/s':>7} "
        f"{'native GB/s':>12} {'F GB/s':>7} {'native/F':>9} {'linear()':>9}"
    )
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        nat = lambda x, w: module.linear_small_m(x, w, None)  # noqa: E731
        for w in weights[:7]:  # agreement, once per M
            x = xs[w.shape[1]]
            torch.testing.assert_close(nat(x, w), F.linear(x, w), rtol=1e-4, atol=1e-3)
        best = {"native": float("inf"), "F": float("inf")}
        for _ in range(args.reps):
            for name, fn in (("native", nat), ("F", F.linear)):
                t = time.thread_time()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                best[name] = min(best[name], time.thread_time() - t)
        flops, nbytes = 2 * m * params, 4 * params
        print(
            f"{m:>3} {best['native'] * 1e3:>10.1f} {best['F'] * 1e3:>8.1f} "
            f"{flops / best['native'] / 1e9:>12.0f} {flops / best['F'] / 1e9:>7.0f} "
            f"{nbytes / best['native'] / 1e9:>12.1f} {nbytes / best['F'] / 1e9:>7.1f} "
            f"{best['native'] / best['F']:>9.2f} {'native' if m <= limit else 'F':>9}",
            flush=True,
        )


if __name__ == "__main__":
    main()
