"""Time one ``Scheduler.schedule()`` call: 256 running decodes plus N waiting prefills.

The replica is Llama-3-8B on one H100 (roofline cost model), T = 50 ms, KV
big enough that memory never binds. Each measured iteration: schedule, then
report the batch's results; new prefills arrive so that the queue stays at N.
Only the ``schedule()`` call is timed.

    python benchmarks/scheduler.py --waiting 100 1000 10000 --policies lars lars-mp
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from medha_sched import (
    BatchResult,
    CacheConfig,
    Request,
    Scheduler,
    SchedulerConfig,
    parse_cost_model_spec,
)


def build(
    policy: str, waiting: int, decodes: int, seed: int
) -> tuple[Scheduler, random.Random, float]:
    rng = random.Random(seed)
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100")
    cache = CacheConfig(block_size=16, num_blocks_per_group=1 << 20)
    sched = Scheduler(SchedulerConfig(policy=policy, target_batch_time=0.05), model, cache=cache)
    for i in range(decodes):  # prefill these to completion first
        sched.add_request(Request(f"d{i}", 0.0, rng.randint(100, 4000), 1 << 20))
    now = 0.0
    while any(r.is_prefilling for r in sched._running.values()) or sched.num_waiting:
        now = step(sched, now)
    for i in range(waiting):
        sched.add_request(new_prefill(rng, f"w{i}", now))
    return sched, rng, now


def new_prefill(rng: random.Random, rid: str, now: float) -> Request:
    long = rng.random() < 0.05
    prompt = rng.randint(20_000, 100_000) if long else rng.randint(50, 4000)
    # One output token: the request finishes with its prefill, so the number
    # of running decodes stays at exactly --decodes.
    return Request(rid, now - rng.random(), prompt, 1)


def step(sched: Scheduler, now: float) -> float:
    out = sched.schedule(now)
    sampled = {c.request_id: 1 for c in out.chunks if c.samples}
    sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))
    return now + max(out.predicted_time, 1e-3)


def measure(policy: str, waiting: int, args: argparse.Namespace) -> dict[str, float]:
    sched, rng, now = build(policy, waiting, args.decodes, args.seed)
    samples, next_id = [], 0
    for _ in range(args.iters):
        t0 = time.perf_counter()
        out = sched.schedule(now)
        samples.append(time.perf_counter() - t0)
        sampled = {c.request_id: 1 for c in out.chunks if c.samples}
        finished = sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))
        now += max(out.predicted_time, 1e-3)
        for _ in range(waiting - sched.num_waiting):  # keep the queue at N
            next_id += 1
            sched.add_request(new_prefill(rng, f"n{next_id}", now))
        del finished
    samples.sort()
    return {
        "p50_us": 1e6 * statistics.median(samples),
        "p99_us": 1e6 * samples[int(0.99 * (len(samples) - 1))],
        "mean_us": 1e6 * statistics.fmean(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--policies", nargs="+", default=["lars", "lars-mp"])
    parser.add_argument("--decodes", type=int, default=256)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{'policy':8} {'waiting':>8} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}")
    for policy in args.policies:
        for waiting in args.waiting:
            r = measure(policy, waiting, args)
            print(
                f"{policy:8} {waiting:>8} {r['p50_us']:>9.0f} {r['p99_us']:>9.0f} "
                f"{r['mean_us']:>9.0f}"
            )


if __name__ == "__main__":
    main()
