"""Micro-benchmark: full re-sort vs KineticIndex.iter_sorted on LARS-like keys.

Each request has work W (lognormal, clipped to [10 ms, 100 s]), arrival a,
deadline a + max(1.5 W, 0.5) and remaining work w; its relative-slack key is
the line ((a + D - w) / W) - t / W. Every decision advances the clock by
--step seconds, makes progress on --update-frac of the requests (their lines
change) and takes the --top best requests. Timed per decision, updates included.

    python benchmarks/priority_index.py [--sizes 100 1000 10000] [--decisions 200]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from itertools import islice

from medha_sched.priority_index import KineticIndex


class Population:
    """Requests as parallel lists; ``line(i)`` is the key line of request ``i``."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.work = [min(max(rng.lognormvariate(0.0, 2.0), 0.01), 100.0) for _ in range(n)]
        self.arrival = [rng.uniform(-5.0, 0.0) for _ in range(n)]
        self.deadline = [
            a + max(1.5 * w, 0.5) for a, w in zip(self.arrival, self.work, strict=True)
        ]
        self.left = [w * rng.uniform(0.1, 1.0) for w in self.work]

    def line(self, i: int) -> tuple[float, float]:
        return (self.deadline[i] - self.left[i]) / self.work[i], -1.0 / self.work[i]

    def progress(self, i: int, seconds: float) -> None:
        self.left[i] = max(self.left[i] - seconds, 1e-3 * self.work[i])


def schedule(n: int, args: argparse.Namespace) -> list[list[tuple[int, float]]]:
    """Per decision, the (request, progress seconds) updates; shared by both methods."""
    rng = random.Random(args.seed + 1)
    k = max(1, round(args.update_frac * n))
    return [
        [(i, rng.uniform(0, args.step)) for i in rng.sample(range(n), k)]
        for _ in range(args.decisions)
    ]


def run_resort(n: int, args: argparse.Namespace) -> tuple[list[float], list[list[int]]]:
    pop = Population(n, random.Random(args.seed))
    b, m = map(list, zip(*(pop.line(i) for i in range(n)), strict=True))
    times, tops, t = [], [], 0.0
    for updates in schedule(n, args):
        start = time.perf_counter()
        t += args.step
        for i, dt in updates:
            pop.progress(i, dt)
            b[i], m[i] = pop.line(i)
        top = sorted(range(n), key=lambda i: (b[i] + m[i] * t, i))[: args.top]
        times.append(time.perf_counter() - start)
        tops.append(top)
    return times, tops


def run_kinetic(n: int, args: argparse.Namespace) -> tuple[list[float], list[list[int]], int]:
    pop = Population(n, random.Random(args.seed))
    index: KineticIndex[int] = KineticIndex()
    for i in range(n):
        b, m = pop.line(i)
        index.add(i, intercept=b, slope=m, tiebreak=(i,))
    index.stats.reset()
    times, tops, t = [], [], 0.0
    for updates in schedule(n, args):
        start = time.perf_counter()
        t += args.step
        index.advance(t)
        for i, dt in updates:
            pop.progress(i, dt)
            b, m = pop.line(i)
            index.update(i, intercept=b, slope=m)
        top = list(islice(index.iter_sorted(t), args.top))
        times.append(time.perf_counter() - start)
        tops.append(top)
    return times, tops, index.stats.events


def p99(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--decisions", type=int, default=200)
    parser.add_argument("--step", type=float, default=0.02, help="clock advance per decision (s)")
    parser.add_argument("--update-frac", type=float, default=0.01)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{'N':>7} {'method':<22} {'mean us':>9} {'p99 us':>9} {'events/dec':>10}")
    for n in args.sizes:
        resort, want = run_resort(n, args)
        kinetic, got, events = run_kinetic(n, args)
        agree = sum(g == w for g, w in zip(got, want, strict=True)) / len(want)
        for name, xs, ev in [
            ("full re-sort", resort, ""),
            ("kinetic iter_sorted", kinetic, events),
        ]:
            mean_us, p99_us = statistics.fmean(xs) * 1e6, p99(xs) * 1e6
            per = f"{ev / args.decisions:.1f}" if ev != "" else "-"
            print(f"{n:>7} {name:<22} {mean_us:>9.1f} {p99_us:>9.1f} {per:>10}")
        print(f"{'':>7} top-{args.top} identical in {agree:.0%} of decisions")


if __name__ == "__main__":
    main()
