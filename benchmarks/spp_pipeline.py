"""Stream pipelining end to end: ``spp=2`` against ``spp=1`` on one long prompt, side by side.

One request of ``--context`` tokens (random byte ids) on ``tiny``, greedy, EOS
ignored, ``--new`` output tokens, one torch thread per rank (``spp=1`` runs in
this process with one thread; ``spp=2`` runs two worker processes with one
thread each). Every layout uses the same scheduler settings: FCFS, fixed
``--chunk``-token prefill chunks, a fixed affine cost model (no start-up
calibration). Three runs per repeat:

- ``spp1``: one process;
- ``spp2``: two stages, stream pipelining on (up to two batches in flight:
  chunk ``i+1`` runs on stage 0 while chunk ``i`` runs on stage 1);
- ``spp2-serial``: two stages, one batch at a time (``pipeline_depth = 1``,
  the runtime's pipeline before stream pipelining), for contrast;
- ``spp2-async`` (asked for with ``--layouts``): ``spp2`` with async
  scheduling: a decode is issued once the batch before it cleared stage 0,
  and the last stage sends its sampled token straight to stage 0;
- ``spp1-async`` (asked for with ``--layouts``): ``spp1`` with async
  scheduling (one process), the fair baseline for ``spp2-async``.

For each it reports TTFT (the wall time from adding the request to the step
that samples the first token), TPOT (median wall time between output
tokens) and whether the greedy tokens equal ``spp1``'s. Beside them, a
projection from CPU time, which a busy machine distorts far less: every rank
reports its thread's CPU seconds per step (without a later stage's wait for the
previous stage's activations, which spins on an idle core before it sleeps:
``Done.cpu_s``), and the projected TTFT is when the
last prefill step would leave the last stage if each stage took exactly that
long (a sum without overlap; a stream pipeline with it); the projected TPOT
is a decode step's CPU time summed over the stages (the driver and the
hand-offs between processes are left out: they are what the wall-clock
figures add). Repeats alternate the
layouts; the report gives the medians, the ratios against ``spp1``, and the
load average before and after (a busy machine slows every layout; the ratios
of one run are the figure to read).

    python benchmarks/spp_pipeline.py                 # 8K-token prompt, 3 repeats
    python benchmarks/spp_pipeline.py --context 2048 --repeats 1   # quicker
    python benchmarks/spp_pipeline.py --layouts spp1,spp2,spp2-async
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import time

import torch

from medha_runtime import SamplingParams
from medha_runtime.engine import LLMEngine
from medha_sched import AffineCostModel

#: name -> (spp, pipeline depth (None: the engine's), async scheduling)
LAYOUTS = {
    "spp1": (1, None, False),
    "spp2": (2, None, False),
    "spp2-serial": (2, 1, False),
    "spp2-async": (2, None, True),
    "spp1-async": (1, None, True),
}
#: what runs when --layouts is not given
DEFAULT_LAYOUTS = ("spp1", "spp2", "spp2-serial")


def time_request(engine: LLMEngine, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    """Run one greedy request alone: (TTFT s, median TPOT s, its output token ids)."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    stamps: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        progress = engine.progress(rid)
        n = len(progress.output_ids) if progress is not None else len(tokens) + 1
        stamps.extend([time.perf_counter()] * (n - len(stamps)))
        for o in outs:
            tokens = o.outputs[0].token_ids
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - t0, statistics.median(gaps) if gaps else float("nan"), tokens


def run_one(name: str, prompt: list[int], args: argparse.Namespace) -> dict:
    spp, depth, async_ = LAYOUTS[name]
    engine = LLMEngine(
        "tiny",
        spp=spp,
        async_scheduling=async_,
        num_threads=1,
        max_model_len=len(prompt) + args.new + 16,
        kv_cache_tokens=len(prompt) + args.new + 64,
        chunk_size=args.chunk,
        policy="fcfs",
        cost_model=AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9),
    )
    cpu: dict[int, list[float]] = {}  # step order -> CPU seconds per stage
    ex = engine.executor
    if spp == 1:
        runner = ex.runner  # type: ignore[attr-defined]
        execute = runner.execute

        def timed(plan):  # type: ignore[no-untyped-def]
            c = time.thread_time()
            try:
                return execute(plan)
            finally:
                cpu[plan.step_id] = [time.thread_time() - c]

        runner.execute = timed
    else:
        ex.timings = []  # type: ignore[attr-defined]
    try:
        if depth is not None:
            engine.pipeline_depth = depth
        ttft, tpot, tokens = time_request(engine, prompt, args.new)
        if spp > 1:
            stage0 = ex.stage0  # type: ignore[attr-defined]
            for step_id, rank, _, c in ex.timings:  # type: ignore[attr-defined]
                cpu.setdefault(step_id, [0.0, 0.0])[0 if rank in stage0 else 1] = c
        prefill = -(-len(prompt) // args.chunk)
        steps = [cpu[k] for k in sorted(cpu)]
        return {
            "ttft_cpu": _makespan(steps[:prefill], overlap=depth is None),
            "stage_cpu": [sum(c[i] for c in steps[:prefill]) for i in range(spp)],
            "tpot_cpu": statistics.median(sum(c) for c in steps[prefill:]),
            "ttft": ttft,
            "tpot": tpot,
            "tokens": tokens,
            "in_flight": engine.stats.max_in_flight,
            "steps": engine.stats.steps,
        }
    finally:
        engine.shutdown()


def _makespan(steps: list[list[float]], *, overlap: bool) -> float:
    """When the last step leaves the last stage if each stage took exactly its
    CPU time: one step at a time, or a stream pipeline (step i+1 enters stage 0
    when step i leaves it)."""
    if not overlap:
        return sum(sum(c) for c in steps)
    ends = [0.0] * len(steps[0])
    for c in steps:
        t = 0.0
        for stage, cs in enumerate(c):
            t = max(t, ends[stage]) + cs
            ends[stage] = t
    return ends[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="output tokens")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--layouts",
        default=",".join(DEFAULT_LAYOUTS),
        help=f"comma-separated, of {', '.join(LAYOUTS)}",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompt = [rng.randrange(0, 256) for _ in range(args.context)]
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout {unknown[0]!r}: one of {', '.join(LAYOUTS)}")
    load0 = os.getloadavg()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            r = run_one(name, prompt, args)
            runs[name].append(r)
            print(
                f"repeat {rep} {name:12s} TTFT {r['ttft']:.3f} s  TPOT {1e3 * r['tpot']:.2f} ms  "
                f"(CPU-time projection: TTFT {r['ttft_cpu']:.3f} s, TPOT "
                f"{1e3 * r['tpot_cpu']:.2f} ms; prefill CPU s per stage "
                f"{'/'.join(f'{c:.3f}' for c in r['stage_cpu'])})  steps {r['steps']}  "
                f"max in flight {r['in_flight']}",
                flush=True,
            )
    load1 = os.getloadavg()
    print(
        f"\ncontext {args.context}, {args.new} new tokens, {args.chunk}-token chunks, "
        f"{args.repeats} repeats; load average {load0[0]:.1f} before, {load1[0]:.1f} after"
    )
    base = names[0]
    ref_tokens = runs[base][0]["tokens"]
    ttft0 = statistics.median(r["ttft"] for r in runs[base])
    tpot0 = statistics.median(r["tpot"] for r in runs[base])
    ttftc0 = statistics.median(r["ttft_cpu"] for r in runs[base])
    tpotc0 = statistics.median(r["tpot_cpu"] for r in runs[base])
    print(
        f"{'layout':12s} {'TTFT s':>8s} {'speed-up':>9s} {'TPOT ms':>8s} {'x':>6s}  "
        f"{'CPU TTFT':>8s} {'speed-up':>9s} {'CPU TPOT':>8s} {'x':>6s}  same tokens"
    )
    for name in names:
        keys = [k for k in runs[name][0] if k not in ("tokens", "stage_cpu")]
        med = {k: statistics.median(r[k] for r in runs[name]) for k in keys}
        same = all(r["tokens"] == ref_tokens for r in runs[name])
        print(
            f"{name:12s} {med['ttft']:8.3f} {ttft0 / med['ttft']:8.2f}x "
            f"{1e3 * med['tpot']:8.2f} {med['tpot'] / tpot0:5.2f}x  "
            f"{med['ttft_cpu']:8.3f} {ttftc0 / med['ttft_cpu']:8.2f}x "
            f"{1e3 * med['tpot_cpu']:8.2f} {med['tpot_cpu'] / tpotc0:5.2f}x  {same}"
        )


if __name__ == "__main__":
    main()
