"""Async scheduling under arrivals: how many batches are shipped while another is in flight.

``--requests`` (200) greedy requests on ``tiny`` (prompts of 8-63 tokens,
16-127 new tokens, EOS ignored) arrive ``--per-step`` (2) at a time every
``--every`` (4) engine steps, so prefills end while decodes run and requests
finish at different steps. The engine runs them without and with async
scheduling (``--repeats`` alternating pairs, one torch thread, a fixed cost
model). For each it prints the batches shipped, how many of them were
shipped while another batch was in flight (submitted, its tokens not yet
read back: overlapped), and the run's
wall time. Without async scheduling none overlap; with it every batch should,
except where the scheduler must wait (a KV block not free, a lane over
``max_batch_requests``, two lanes to merge).

    python benchmarks/async_overlap.py
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from medha_runtime import SamplingParams
from medha_runtime.engine import LLMEngine
from medha_sched import AffineCostModel


def run(args: argparse.Namespace, async_: bool) -> tuple[int, int, float]:
    """One engine, every request to completion: (batches, overlapped, wall seconds)."""
    engine = LLMEngine(
        "tiny",
        async_scheduling=async_,
        num_threads=1,
        max_model_len=256,
        kv_cache_tokens=64 * 256,
        policy="fcfs",
        max_batch_requests=64,
        cost_model=AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9),
    )
    ex = engine.executor
    submit = ex.submit
    counts = [0, 0]

    def counting(plan):  # type: ignore[no-untyped-def]
        counts[0] += 1
        counts[1] += ex.in_flight > 0
        return submit(plan)

    ex.submit = counting  # type: ignore[method-assign]
    rng = random.Random(0)
    added = steps = 0
    try:
        t = time.perf_counter()
        while added < args.requests or engine.has_unfinished_requests():
            if added < args.requests and steps % args.every == 0:
                for _ in range(min(args.per_step, args.requests - added)):
                    ids = [rng.randrange(3, 250) for _ in range(rng.randrange(8, 64))]
                    n = rng.randrange(16, 128)
                    engine.add_request(
                        ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                    )
                    added += 1
            engine.step()
            steps += 1
        wall = time.perf_counter() - t
    finally:
        engine.shutdown()
    return counts[0], counts[1], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--per-step", type=int, default=2)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for _ in range(args.repeats):
        for async_ in (False, True):
            batches, overlapped, wall = run(args, async_)
            mode = "async" if async_ else "sync "
            print(
                f"{mode}: {batches} batches, {overlapped} shipped while another was in flight "
                f"({100 * overlapped / batches:.1f}%), wall {wall:.2f} s, "
                f"load average {os.getloadavg()[0]:.1f}"
            )


if __name__ == "__main__":
    main()
