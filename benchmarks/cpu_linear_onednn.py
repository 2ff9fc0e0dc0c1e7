"""fp32 ``F.linear`` (BLAS) against oneDNN's ``_linear_pointwise`` at prefill row counts.

SmolLM2-135M's four products per layer (q/k/v 576 -> 960, o 576 -> 576, gate/up
576 -> 3,072, down 1,536 -> 576), one thread, best of 5 by CPU time; then each
one's largest error against a float64 truth (three seeds, 2,048 rows), the
bound :func:`tests.numerics.assert_twice_torch` applies being twice
``F.linear``'s plus ``4 eps max(1, |truth|)``. The "first" column is oneDNN's
first call at that row count and shape (it builds its kernel for the shape
then: what a chunk or batch of a new size pays once per product).

    python benchmarks/cpu_linear_onednn.py
    python benchmarks/cpu_linear_onednn.py --reps 9
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
ROWS = [64, 128, 256, 512, 1024, 2047, 2048]


def best(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed calls per product (best)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    torch.set_num_threads(1)
    dnn = torch.ops.mkldnn._linear_pointwise
    print("rows | " + " | ".join(f"{k}x{n} BLAS/oneDNN ms (ratio), first" for k, n in SHAPES))
    for m in ROWS:
        cells = []
        for k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
            a = best(lambda x=x, w=w: F.linear(x, w), args.reps)
            first = best(lambda x=x, w=w: dnn(x, w, None, "none", [], ""), 1)
            b = best(lambda x=x, w=w: dnn(x, w, None, "none", [], ""), args.reps)
            cells.append(f"{a * 1e3:.2f}/{b * 1e3:.2f} ({a / b:.2f}x), {first * 1e3:.2f}")
        print(f"{m} | " + " | ".join(cells), flush=True)
    for k, n in SHAPES:
        for seed in range(3):
            torch.manual_seed(seed)
            x, w = torch.randn(2048, k), torch.randn(n, k) / k**0.5
            truth = F.linear(x.double(), w.double())
            e_blas = (F.linear(x, w).double() - truth).abs().max().item()
            e_dnn = (dnn(x, w, None, "none", [], "").double() - truth).abs().max().item()
            bound = 2 * e_blas + 4 * torch.finfo(torch.float32).eps * max(1.0, truth.abs().max())
            print(
                f"K={k} N={n} seed {seed}: max error BLAS {e_blas:.2e}, oneDNN {e_dnn:.2e}, "
                f"bound {bound:.2e}: {'within' if e_dnn <= bound else 'OUTSIDE'}"
            )


if __name__ == "__main__":
    main()
