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

It prints the median share of each step's wall time in which the rank did
not compute, and the driver's serial work measured directly: from the moment
a batch's tokens come back to the moment the next batch is submitted (the
rest of the driver's work, detokenizing, runs while the rank computes). Its
CPU time (the driver thread's clock) against the rank's is the figure a busy
machine distorts least.

``--modes sync async`` runs the engine without and with async scheduling
(``LLMEngine(async_scheduling=True)``: batch N+1 is formed and shipped while
the ranks run batch N), alternating ``--repeats`` times in one process. In
process the rank's busy time is also measured as intervals, so "no rank
computing" is the share of each step's wall interval that no ``execute``
covers (``idle`` below; with the engine waiting on the rank it is the same
figure as before, with async scheduling the rank's work of one step may
start in the previous one). With ``--layout tp2`` it stays the step's wall
time less the sampling rank's compute time, over the step's wall time (the
median over the timed steps: in steady state each step's wall holds one
batch's compute either way). With async scheduling the driver's window from
a batch's end to the next submit overlaps the ranks' next batch: it is no
longer serial. The summary also gives the decode throughput, the running
requests over the median step wall.

    python benchmarks/driver_overhead.py
    python benchmarks/driver_overhead.py --layout tp2
    python benchmarks/driver_overhead.py --modes sync async --repeats 3
    python benchmarks/driver_overhead.py --layout tp2 --modes sync async --repeats 3
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
from medha_runtime.executor import StepDone
from medha_sched import AffineCostModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layout", choices=("1", "tp2"), default="1")
    ap.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync"])
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            results[mode].append(measure(args, mode == "async"))
    if len(args.modes) > 1 or args.repeats > 1:
        med = statistics.median
        print(f"summary, {args.repeats} run(s) each, load average {os.getloadavg()[0]:.1f}:")
        for mode, runs in results.items():
            idle = ", ".join(f"{100 * i:.1f}%" for i, _ in runs)
            mid = 100 * med(i for i, _ in runs)
            wall = med(w for _, w in runs)
            print(
                f"  {mode:5s}: no rank computing {idle} (median {mid:.1f}%)"
                f", step wall median {1e3 * wall:.2f} ms"
                f", decode {args.requests / wall:.0f} tokens/s"
            )


def measure(args: argparse.Namespace, async_: bool) -> tuple[float, float]:
    """One engine, one timed run; returns (median idle share, median step wall seconds)."""
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
        async_scheduling=async_,
    )
    compute: list[float] = []  # the rank's wall seconds per step
    compute_cpu: list[float] = []  # the rank's CPU seconds per step
    gaps: list[tuple[float, float]] = []  # driver alone: a batch's end to the next submit
    busy: list[tuple[float, float]] = []  # the rank's execute intervals (in-process)
    ex = engine.executor
    if tp == 1:
        runner = ex.runner  # type: ignore[attr-defined]
        execute = runner.execute

        def timed(plan):  # type: ignore[no-untyped-def]
            t, c = time.perf_counter(), time.thread_time()
            try:
                return execute(plan)
            finally:
                end = time.perf_counter()
                compute.append(end - t)
                compute_cpu.append(time.thread_time() - c)
                busy.append((t, end))

        runner.execute = timed
    else:
        ex.timings = []  # type: ignore[attr-defined]
    ended: list[tuple[float, float]] = []
    next_event, submit = ex.next_event, ex.submit

    def on_event():  # type: ignore[no-untyped-def]
        event = next_event()
        if isinstance(event, StepDone):
            ended.append((time.perf_counter(), time.thread_time()))
        return event

    def on_submit(plan):  # type: ignore[no-untyped-def]
        if ended:
            t, c = ended.pop()
            gaps.append((time.perf_counter() - t, time.thread_time() - c))
        return submit(plan)

    ex.next_event, ex.submit = on_event, on_submit  # type: ignore[method-assign]
    try:
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
        for _ in range(args.requests):
            engine.add_request([rng.randrange(0, 256) for _ in range(args.prompt)], params)
        full = 0  # prefill, then decode steps until three in a row run every request
        while full < 3:
            before = engine.stats.decode_tokens
            engine.step()
            full = full + 1 if engine.stats.decode_tokens - before == args.requests else 0
        walls = []
        spans = []
        gaps.clear()
        last = time.perf_counter()
        for _ in range(args.steps):
            before = engine.stats.decode_tokens
            engine.step()
            now = time.perf_counter()
            assert engine.stats.decode_tokens - before == args.requests, "not a full decode step"
            walls.append(now - last)
            spans.append((last, now))
            last = now
        if tp == 1:
            rank_wall, rank_cpu = compute[-args.steps :], compute_cpu[-args.steps :]
            # the share of each step's interval that no execute covers
            idle = [1.0 - covered(busy, a, b) / (b - a) for a, b in spans]
        else:
            sampler = ex.sampler_rank  # type: ignore[attr-defined]
            mine = [t for t in ex.timings if t[1] == sampler][-args.steps :]  # type: ignore[attr-defined]
            rank_wall, rank_cpu = [t[2] for t in mine], [t[3] for t in mine]
            idle = [max(0.0, w - r) / w for w, r in zip(walls, rank_wall, strict=True)]
        gap_wall = [g[0] for g in gaps[-args.steps :]]
        gap_cpu = [g[1] for g in gaps[-args.steps :]]
        cpu_share = [g / (g + r) for g, r in zip(gap_cpu, rank_cpu, strict=False)]
        load = os.getloadavg()[0]
        mode = "async scheduling" if async_ else "sync"
        print(
            f"layout {args.layout} ({mode}): {args.requests} running decodes on tiny, "
            f"{args.steps} steps, load average {load:.1f}"
        )
        med = statistics.median
        print(
            f"step wall {1e3 * med(walls):.2f} ms, the rank computing {1e3 * med(rank_wall):.2f} "
            f"ms of it ({1e3 * med(rank_cpu):.2f} ms CPU)"
        )
        print(f"no rank computing (wall): median {100 * med(idle):.1f}% of the step")
        if gaps:
            print(
                f"driver, a batch's end to the next submit: {1e3 * med(gap_wall):.2f} ms wall, "
                f"{1e3 * med(gap_cpu):.2f} ms CPU = {100 * med(cpu_share):.1f}% of the step's "
                "CPU time" + (" (overlaps the rank's next batch)" if async_ else "")
            )
        return med(idle), med(walls)
    finally:
        engine.shutdown()


def covered(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of ``[a, b]`` inside any of ``intervals`` (disjoint: one model thread)."""
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in intervals)


if __name__ == "__main__":
    main()
