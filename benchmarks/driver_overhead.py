"""Driver overhead: the share of each engine step in which no rank computes.

``--requests`` (64) requests of ``--prompt`` tokens on ``tiny`` are prefilled,
then ``--steps`` decode steps of all of them are timed (greedy, EOS ignored,
one torch thread). For every step it records the wall time of
``LLMEngine.step()`` from the end of the previous one, and the time the rank
spent computing it (``ModelRunner.execute``: build the batch, run the model,
sample), measured inside the rank; the rest is the driver's (schedule, plan,
ship, read the tokens back, detokenize, stop checks, ``on_batch_end``).

``--layout 1`` runs the rank in this process; ``--layout tp2`` in two worker
processes (the compute time is then the sampling rank's, read from its
reply, and the overhead also holds the pipe round trip).

It prints the median and mean overhead share and the CPU time of the driver
per step (this process's thread clock), which a busy machine distorts less.

    python benchmarks/driver_overhead.py
    python benchmarks/driver_overhead.py --layout tp2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from medha_runtime import SamplingParams
from medha_runtime.engine import LLMEngine
from medha_sched import AffineCostModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layout", choices=("1", "tp2"), default="1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tp = 2 if args.layout == "tp2" else 1
    engine = LLMEngine(
        "tiny",
        tp=tp,
        num_threads=1,
        max_model_len=args.prompt + args.steps + 64,
        kv_cache_tokens=args.requests * (args.prompt + args.steps + 64),
        policy="fcfs",
        max_batch_requests=args.requests,
        cost_model=AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9),
    )
    compute: list[float] = []
    compute_cpu: list[float] = []
    if tp == 1:
        runner = engine.executor.runner  # type: ignore[attr-defined]
        execute = runner.execute

        def timed(plan):  # type: ignore[no-untyped-def]
            t, c = time.perf_counter(), time.thread_time()
            try:
                return execute(plan)
            finally:
                compute.append(time.perf_counter() - t)
                compute_cpu.append(time.thread_time() - c)

        runner.execute = timed
    try:
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        for _ in range(args.requests):
            engine.add_request([rng.randrange(0, 256) for _ in range(args.prompt)], params)
        while engine.stats.decode_tokens < args.requests:  # prefill, first decodes
            engine.step()
        walls, shares, cpu = [], [], []
        last = time.perf_counter()
        for _ in range(args.steps):
            c0 = time.thread_time()
            before = engine.stats.decode_tokens
            engine.step()
            now = time.perf_counter()
            cpu.append(time.thread_time() - c0)
            assert engine.stats.decode_tokens - before == args.requests, "not a full decode step"
            wall = now - last
            last = now
            rank = compute[-1] if tp == 1 else engine.executor.last_compute_s  # type: ignore[attr-defined]
            walls.append(wall)
            shares.append(max(0.0, wall - rank) / wall)
        cpu_share = None
        if tp == 1:  # one thread does both, one after the other: CPU shares are load-proof
            ranks = compute_cpu[-args.steps :]
            cpu_share = [(c - r) / c for c, r in zip(cpu, ranks, strict=True)]
            cpu = [c - r for c, r in zip(cpu, ranks, strict=True)]
        load = os.getloadavg()[0]
        print(
            f"layout {args.layout}: {args.requests} running decodes on tiny, {args.steps} steps, "
            f"load average {load:.1f}"
        )
        print(f"step wall: median {1e3 * statistics.median(walls):.2f} ms")
        print(
            f"no rank computing: median {100 * statistics.median(shares):.1f}% of the step, "
            f"mean {100 * statistics.mean(shares):.1f}%"
        )
        print(f"driver CPU per step: median {1e3 * statistics.median(cpu):.2f} ms")
        if cpu_share is not None:
            print(
                f"driver share of the step's CPU time: median "
                f"{100 * statistics.median(cpu_share):.1f}%"
            )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
