"""Time one ``schedule()`` call: D running decodes plus N waiting prefills, three ways.

The replica is Llama-3-8B on one H100 (roofline cost model), T = 50 ms, KV
big enough that memory never binds. Three schedulers run side by side, in
lockstep, on the same work:

- ``new``: ``medha_sched.Scheduler`` (issue 20: decodes in lanes, priced in
  O(1), capacity checked only for block crossers, handed out compactly);
- ``reference``: the algorithm before issue 20, kept verbatim in
  ``tests/sched/reference`` (every decode checked, priced and emitted at
  every step; prefills from the kinetic index);
- ``vidur``: the reference with the prefill queue fully re-sorted at every
  step, as vidur's Mnemosyne schedulers do.

Each measured iteration: every scheduler forms a batch (only that call is
timed; the order rotates), the batches are checked equal for the first
``--check`` steps, every batch's results are reported, and new prefills
arrive so that the queue stays at N. ``new`` hands its decodes out
compactly; the ``+chunks`` column adds spelling every chunk out
(``out.chunks``), which an executor that wants them all pays, and ``end``
is the mean ``on_batch_end`` call. The batch cap is raised to twice the
decodes when that exceeds the default 512 (else decodes past 512 would wait),
and with more than 256 decodes their prompts shrink in proportion, so that
their total KV stays that of 256 decodes. Even so, 1,024 decodes alone
outgrow T = 50 ms as they decode (prefills then starve), so compare 256 and
1,024 decodes at a larger ``--target``, say 0.2 s.
``--cpu-time`` times with the thread's CPU clock instead of the wall clock:
on a shared machine, time the process spent descheduled is then left out.
``--warmup K`` runs K steps first, untimed (but checked): the N waiting
prefills all arrive at once with nearly the same LARS slack, and their keys
cross often while they fan out. With the kinetic index's leaves in order of
arrival that was a burst of certificate failures (about 250 per step at
first with 10,000 waiting); with leaves laid out by slope (since 2026-11-25)
it is at most about 10 per step, so the default (no warm-up) times the
start-up and a warm-up times a queue in its steady state.
Each configuration (policy, decodes, waiting) runs in a fresh interpreter
(``--in-process``: all in this one, as before 2026-11-26): in one process a
configuration run after the 10,000-waiting ones read 2-10 µs slower at p50
than the same configuration run first (lars and lars-mp make the very same
calls and batches here; whichever ran later read slower). Each
configuration's timed steps also start after a full garbage collection:
without it the configurations run before (their schedulers and requests)
were collected by a generation-2 pass inside some later timed call (tens of ms
at 10,000 waiting), which moved the mean of whichever ran later.

``--repeats R`` runs every configuration R times, in rounds (each run a
fresh interpreter), and prints each column's median over the runs and the
range of the p99s: on a shared machine one 300-step run's p99 (its 4th
slowest step) moves by a third from run to run.

    python benchmarks/scheduler.py --waiting 1000 10000 --policies lars lars-mp
    python benchmarks/scheduler.py --decodes 256 1024 --waiting 1000 --policies lars
    python benchmarks/scheduler.py --iters 300 --cpu-time --impls new --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from medha_sched import (
    BatchResult,
    CacheConfig,
    Request,
    Scheduler,
    SchedulerConfig,
    parse_cost_model_spec,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.sched.reference import ReferenceScheduler, ResortQueue

ALL_IMPLS = ("new", "reference", "vidur")


def build(impl: str, policy: str, decodes: int, seed: int, target: float = 0.05):
    """A scheduler with ``decodes`` requests past their prefill; (scheduler, clock)."""
    rng = random.Random(seed)
    model = parse_cost_model_spec("roofline:model=llama3-8b,gpu=h100")
    cache = CacheConfig(block_size=16, num_blocks_per_group=1 << 20)
    cap = max(SchedulerConfig().max_batch_requests, 2 * decodes)
    config = SchedulerConfig(policy=policy, target_batch_time=target, max_batch_requests=cap)
    if impl == "new":
        sched = Scheduler(config, model, cache=cache)
    elif impl == "reference":
        sched = ReferenceScheduler(config, model, cache=cache)
    else:
        sched = ReferenceScheduler(config, model, cache=cache, queue=ResortQueue)
    # Prompts of 100-4,000 tokens for 256 decodes, shorter for more: the decodes'
    # KV stays the same in total, so they keep the same share of the budget T
    # (1,024 decodes of 2,000 tokens alone would take longer than T).
    hi = 4000 * 256 // max(decodes, 256)
    for i in range(decodes):  # prefill these to completion first
        sched.add_request(Request(f"d{i}", 0.0, rng.randint(min(100, hi // 4), hi), 1 << 20))
    now, stalled = 0.0, 0
    while sched.num_waiting or any(r.is_prefilling for r in sched._running.values()):
        out = sched.schedule(now)
        # decodes alone at or over T leave no room for a prefill chunk, for good
        # (their KV only grows): stop with the fix instead of looping forever
        prefilled = any(c.num_tokens > 1 or not c.samples for c in out.chunks)
        stalled = 0 if prefilled else stalled + 1
        if stalled >= 3:
            sys.exit(
                f"{decodes} decodes alone fill --target {target} s, so the rest of "
                "their prompts never get a chunk: raise --target (0.2 s for 1,024)"
            )
        sampled = {c.request_id: 1 for c in out.chunks if c.samples}
        sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))
        now += max(out.predicted_time, 1e-3)
    return sched, now


def new_prefill(rng: random.Random, rid: str, now: float) -> tuple[str, float, int]:
    long = rng.random() < 0.05
    prompt = rng.randint(20_000, 100_000) if long else rng.randint(50, 4000)
    # One output token: the request finishes with its prefill, so the number
    # of running decodes stays at exactly --decodes.
    return rid, now - rng.random(), prompt


def same(a, b, step: int, name: str) -> None:
    if (a.chunks, a.preempted, a.predicted_time, a.target_time) != (
        b.chunks,
        b.preempted,
        b.predicted_time,
        b.target_time,
    ):
        sys.exit(f"step {step}: {name} formed a different batch than new")


def measure(policy: str, waiting: int, decodes: int, args: argparse.Namespace) -> dict:
    impls = args.impls
    scheds, clocks = {}, []
    for impl in impls:
        scheds[impl], t = build(impl, policy, decodes, args.seed, args.target)
        clocks.append(t)
    assert len(set(clocks)) == 1, "the set-ups differ"
    now = clocks[0]
    rng = random.Random(args.seed + 1)
    specs = [new_prefill(rng, f"w{i}", now) for i in range(waiting)]
    for s in scheds.values():
        for rid, arrival, prompt in specs:
            s.add_request(Request(rid, arrival, prompt, 1))
    # The previous configurations' garbage (a 10,000-waiting run leaves much)
    # and the set-up's is collected now, not by a pass inside a timed call.
    gc.collect()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    times = {impl: [] for impl in impls}
    spell, end = [], {impl: [] for impl in impls}
    next_id = 0
    for step in range(args.warmup + args.iters):
        timed = step >= args.warmup
        k = step % len(impls)
        order = impls[k:] + impls[:k]
        outs = {}
        for impl in order:
            s = scheds[impl]
            t0 = clock()
            outs[impl] = s.schedule(now)
            if timed:
                times[impl].append(clock() - t0)
        t0 = clock()
        chunks = outs["new"].chunks
        if timed:
            spell.append(clock() - t0)
        if step < args.check:
            for impl in impls[1:]:
                same(outs["new"], outs[impl], step, impl)
        sampled = {c.request_id: 1 for c in chunks if c.samples}
        result = BatchResult(sampled_token_ids=sampled)
        for impl in order:
            t0 = clock()
            scheds[impl].on_batch_end(outs[impl].batch_id, result)
            if timed:
                end[impl].append(clock() - t0)
        now += max(outs["new"].predicted_time, 1e-3)
        arrivals = []
        for _ in range(waiting - scheds["new"].num_waiting):  # keep the queue at N
            next_id += 1
            arrivals.append(new_prefill(rng, f"n{next_id}", now))
        for s in scheds.values():
            for rid, arrival, prompt in arrivals:
                s.add_request(Request(rid, arrival, prompt, 1))
    rows = {impl: stats(times[impl], end[impl]) for impl in impls}
    rows["new"]["plus_chunks_p50_us"] = 1e6 * statistics.median(
        [a + b for a, b in zip(times["new"], spell, strict=True)]
    )
    return rows


def measure_fresh(policy: str, waiting: int, decodes: int, args: argparse.Namespace) -> dict:
    """:func:`measure` in a new interpreter (spawned), so that what earlier
    configurations left in this process's heap cannot slow this one."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure, policy, waiting, decodes, args).result()


def stats(samples: list[float], ends: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50_us": 1e6 * statistics.median(ordered),
        "p99_us": 1e6 * ordered[int(0.99 * (len(ordered) - 1))],
        "mean_us": 1e6 * statistics.fmean(ordered),
        "end_us": 1e6 * statistics.fmean(ends),
    }


def print_rows(config: tuple, runs: list[dict], impls: tuple[str, ...]) -> None:
    """One line per implementation: the run's numbers, or with several runs each
    column's median over them and the range of the p99s."""
    policy, decodes, waiting = config

    def med(impl: str, key: str) -> float:
        return statistics.median(r[impl][key] for r in runs)

    base = med("new", "p50_us")
    for impl in impls:
        plus = f"{med(impl, 'plus_chunks_p50_us'):8.0f}" if impl == "new" else f"{'':8}"
        line = (
            f"{policy:8} {decodes:>7} {waiting:>7} {impl:10} {med(impl, 'p50_us'):>8.0f} "
            f"{med(impl, 'p99_us'):>8.0f} {med(impl, 'mean_us'):>8.0f} {plus} "
            f"{med(impl, 'end_us'):>7.0f} {med(impl, 'p50_us') / base:>9.2f}"
        )
        if len(runs) > 1:
            p99s = [r[impl]["p99_us"] for r in runs]
            line += f" {f'{min(p99s):.0f}-{max(p99s):.0f}':>13}"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--policies", nargs="+", default=["lars", "lars-mp"])
    parser.add_argument("--decodes", type=int, nargs="+", default=[256])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--check", type=int, default=200, help="steps checked equal")
    parser.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread CPU clock")
    parser.add_argument("--target", type=float, default=0.05, help="T, seconds")
    parser.add_argument(
        "--impls", nargs="+", default=list(ALL_IMPLS), choices=ALL_IMPLS, help="new comes first"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every configuration in this process (default: a fresh one each)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every configuration, in rounds (each in a fresh process unless "
        "--in-process); with more than one, each column is the median over the runs",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    args.impls = tuple(["new"] + [i for i in args.impls if i != "new"])
    head = (
        f"{'policy':8} {'decodes':>7} {'waiting':>7} {'impl':10} {'p50 us':>8} {'p99 us':>8} "
        f"{'mean us':>8} {'+chunks':>8} {'end us':>7} {'p50 x new':>9}"
    )
    if args.repeats > 1:
        head += f" {'p99 range us':>13}"
    print(head)
    configs = [
        (policy, decodes, waiting)
        for policy in args.policies
        for decodes in args.decodes
        for waiting in args.waiting
    ]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats):  # rounds: every configuration once per round
        for config in configs:
            policy, decodes, waiting = config
            run = measure if args.in_process else measure_fresh
            runs[config].append(run(policy, waiting, decodes, args))
            if repeat == args.repeats - 1:
                print_rows(config, runs[config], args.impls)
    if len(args.impls) > 1:
        names = ", ".join(args.impls)
        checked = min(args.check, args.warmup + args.iters)
        print(f"{names} formed the same batches in the first {checked} steps of every run")


if __name__ == "__main__":
    main()
