"""KV-cache parallelism end to end: ``kvp=2`` against ``kvp=1`` on one long prompt, side by side.

One request of ``--context`` tokens (random byte ids) on ``tiny``, greedy, EOS
ignored, ``--new`` output tokens, one torch thread per rank (``kvp=1`` runs in
this process with one thread; ``kvp=2`` runs two worker processes with one
thread each). Both layouts use the same scheduler settings: FCFS, fixed
``--chunk``-token prefill chunks, a fixed affine cost model (no start-up
calibration).

For each layout and repeat it reports:

- prefill: the wall time from the first step to the step that samples the first token;
- TPOT: the median wall time of the decode steps;
- CPU time (user + system) for prefill and per decode step (the mean): the
  driver's from its process clock, each worker's from the scheduler's run
  time of its threads (``/proc/PID/task/*/schedstat``, nanoseconds; the
  process clocks of ``/proc/PID/stat`` tick every 10 ms, 0.16 ms a step over
  63 decode steps, where schedstat is missing): "path" is the driver's plus the busiest
  worker's (what a quiet machine's wall time follows: the driver waits for
  the workers, which wait for each other at every merge), "total" every
  process's. On a busy machine the CPU time is the steadier measure;
- with worker processes, each rank's own decode step (``runner.execute`` in
  the worker, wall and thread CPU: the median per rank, the busiest rank's);
- the greedy tokens, which must be identical.

Repeats alternate the layouts (1, 2, 1, 2, ...) and the report gives the
ratio ``kvp=2 / kvp=1`` of the medians, and the load average before and after.

``--modes sync async`` runs each layout without and with async scheduling
(``LLMEngine(async_scheduling=True)``: batch N+1 is formed and shipped while
the ranks run batch N; with ``kvp=2`` the sampling rank broadcasts its tokens
to the other rank), alternating within each repeat (sync kvp=1, sync kvp=2,
async kvp=1, async kvp=2, ...); the greedy tokens must be identical across
every mode and layout. With async scheduling a decode step's wall time is
still the interval between two ``step()`` returns, and its CPU time counts
the driver's work for the next batch, which overlaps the ranks' work.

    python benchmarks/kvp_decode.py                       # 32K context, 2 repeats
    python benchmarks/kvp_decode.py --context 8192 --new 16 --repeats 1   # quicker
    python benchmarks/kvp_decode.py --context 32768 --new 64 --repeats 3 --modes sync async

``--ranks`` times the ranks alone instead (no engine, no driver): one decode
step at the end of the context, run ``--steps`` times by ``ModelRunner`` s
joined over gloo (forkserver, ``file://``, one thread each), for ``kvp=1``
and for ``kvp=2`` with the shared-memory merge and with gloo's; it reports
each rank's wall and thread CPU time per step (medians). With ``--modes sync
async`` the step samples its row (greedy) and runs kvp=1 and kvp=2 (the
shared-memory merge) per mode; ``async`` decodes ``PENDING_TOKEN``, the
sampling rank broadcasting each step's token to the other rank as under async
scheduling.

``--interleave W`` keeps both layouts alive at once: each is prefilled, then
their decode steps run in alternating windows of ``W`` steps (kvp=1's window,
kvp=2's, ...) until each produced ``--new`` tokens, so both meet the same
moments of a machine whose speed drifts (separate runs time their decodes tens
of seconds apart, after long prefills). It prints each layout's median step,
their ratio, the median ratio of neighbouring windows, CPU per step, and whether
the greedy tokens are identical, per mode::

    python benchmarks/kvp_decode.py --interleave 16 --new 513 --modes sync async

On the 2-core VM (2026-11-27) both layouts' decode steps cost 10-20% more CPU
this way than in separate runs, kvp=2's more than kvp=1's, so the ratio reads
higher (0.8-0.9 against 0.7-0.8); the cause is not established.

``--merge`` times one KVP merge of a decode's state (one query, tiny's 4 heads
x 16) between two ranks, through shared memory and through gloo: wall and
thread CPU time per merge (medians of ``--steps`` x 10); with ``--peer-ms``
rank 1 computes that long before each merge, so rank 0 waits for it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launch harness: tests/
from tests.parallel.dist import launch

from medha_runtime import SamplingParams
from medha_runtime.engine import LLMEngine
from medha_sched import AffineCostModel

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)


def _cpu(pids: list[int]) -> list[float]:
    """User + system CPU seconds of each process so far (this one first)."""
    return [time.process_time(), *(_process_cpu(pid) for pid in pids[1:])]


def _process_cpu(pid: int) -> float:
    """CPU seconds of another process's threads: their schedstat run times (ns)
    where Linux has them, else its 10 ms process clock ticks."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        return sum(psutil.Process(pid).cpu_times()[:2])


def _phase(before: list[float], after: list[float], steps: int = 1) -> dict[str, float]:
    """CPU seconds per step: every process summed, and the critical path.

    The path is the driver's CPU plus the busiest worker's (the driver waits
    for the workers, which wait for each other at every merge); in process,
    the driver's alone.
    """
    used = [(b - a) / steps for a, b in zip(before, after, strict=True)]
    worker = max(used[1:], default=0.0)
    return {"total": sum(used), "path": used[0] + worker, "driver": used[0], "worker": worker}


def _engine(kvp: int, prompt: list[int], args: argparse.Namespace, async_: bool) -> LLMEngine:
    """The engine every layout runs: ``tiny``, one thread per rank, FCFS, fixed chunks and
    cost model; with ``kvp`` > 1 the context split evenly over the groups."""
    context = len(prompt) + args.new
    group = -(-context // kvp // args.block) * args.block
    return LLMEngine(
        "tiny",
        dtype="float32",
        kvp=kvp,
        kvp_group_tokens=group if kvp > 1 else None,
        num_threads=1,
        policy="fcfs",
        chunk_size=args.chunk,
        max_model_len=kvp * group,
        kv_cache_tokens=group * 9 // 8 // args.block * args.block,
        block_size=args.block,
        cost_model=COST,
        attention_backend=args.backend,
        async_scheduling=async_,
    )


def interleaved(args: argparse.Namespace, prompt: list[int], async_: bool) -> dict:
    """``--interleave W``: kvp=1 and kvp=k alive together, each prefilled (one after
    the other), then their decode steps in alternating windows of ``W`` steps (kvp=1's
    window, kvp=k's, and so on) until each produced ``--new`` tokens: both layouts'
    steps meet the same moments of a machine whose speed drifts, where separate runs
    time them tens of seconds apart. Returns each layout's decode step walls (s) per
    window, its tokens, and each layout's driver and worker CPU seconds per decode step."""
    k = args.kvp
    engines = {kvp: _engine(kvp, prompt, args, async_) for kvp in (1, k)}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
        rids = {kvp: e.add_request(prompt, params) for kvp, e in engines.items()}
        outs: dict[int, object] = {}
        for kvp, e in engines.items():  # prefill: until the first token
            while e.has_unfinished_requests():
                for o in e.step():
                    outs[kvp] = o
                p = e.progress(rids[kvp])
                if p is not None and len(p.output_ids) >= 1:
                    break
        windows: dict[int, list[list[float]]] = {1: [], k: []}
        cpu = {kvp: [0.0, 0.0] for kvp in engines}  # driver, busiest worker (s)
        pids = {kvp: [os.getpid(), *getattr(e.executor, "pids", [])] for kvp, e in engines.items()}
        while any(e.has_unfinished_requests() for e in engines.values()):
            for kvp, e in engines.items():
                walls: list[float] = []
                c0 = _cpu(pids[kvp])
                while len(walls) < args.interleave and e.has_unfinished_requests():
                    s0 = time.perf_counter()
                    done = e.step()
                    walls.append(time.perf_counter() - s0)
                    for o in done:
                        outs[kvp] = o
                used = [b - a for a, b in zip(c0, _cpu(pids[kvp]), strict=True)]
                cpu[kvp][0] += used[0]
                cpu[kvp][1] += max(used[1:], default=0.0)
                if walls:
                    windows[kvp].append(walls)
        steps = {kvp: sum(len(w) for w in ws) for kvp, ws in windows.items()}
        return {
            "windows": windows,
            "tokens": {kvp: list(o.outputs[0].token_ids) for kvp, o in outs.items()},  # type: ignore[attr-defined]
            "cpu": {kvp: [c / max(steps[kvp], 1) for c in cs] for kvp, cs in cpu.items()},
        }
    finally:
        for e in engines.values():
            e.shutdown()


def report_interleaved(args: argparse.Namespace, prompt: list[int]) -> None:
    """Run :func:`interleaved` for each mode and print its medians and ratios."""
    k = args.kvp
    print(f"load average before: {os.getloadavg()}")
    rows = []
    for mode in dict.fromkeys(args.modes):
        r = interleaved(args, prompt, mode == "async")
        w1, wk = r["windows"][1], r["windows"][k]
        t1 = statistics.median(t for w in w1 for t in w)
        tk = statistics.median(t for w in wk for t in w)
        # the ratio of each pair of neighbouring windows (kvp=1's, then kvp=k's)
        pairs = [statistics.median(b) / statistics.median(a) for a, b in zip(w1, wk, strict=False)]
        same = r["tokens"][1] == r["tokens"][k]
        rows.append((mode, t1, tk, pairs, same))
        print(
            f"{mode}: TPOT kvp=1 {1e3 * t1:.2f} ms, kvp={k} {1e3 * tk:.2f} ms, ratio "
            f"{tk / t1:.2f} (window pairs: median {statistics.median(pairs):.2f}, "
            f"range {min(pairs):.2f}-{max(pairs):.2f}, {len(pairs)} pairs); CPU per step "
            f"driver / busiest worker: kvp=1 {1e3 * r['cpu'][1][0]:.2f} / "
            f"{1e3 * r['cpu'][1][1]:.2f} ms, kvp={k} {1e3 * r['cpu'][k][0]:.2f} / "
            f"{1e3 * r['cpu'][k][1]:.2f} ms; greedy tokens identical: {same}; "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}")
    print(
        f"\ncontext {args.context}, {args.new} new tokens, windows of {args.interleave} steps, "
        "1 thread per rank"
    )
    head = f"{'TPOT kvp=1 ms':>14} {f'TPOT kvp={k} ms':>14} {'ratio':>6} {'pairs':>6}"
    print(f"{'mode':>6} {head}  same")
    for mode, t1, tk, pairs, same in rows:
        print(
            f"{mode:>6} {1e3 * t1:14.2f} {1e3 * tk:14.2f} {tk / t1:6.2f} "
            f"{statistics.median(pairs):6.2f}  {same}"
        )


def run(kvp: int, prompt: list[int], args: argparse.Namespace, async_: bool = False) -> dict:
    """One generation with ``kvp`` groups (async scheduling if ``async_``): timings and tokens."""
    engine = _engine(kvp, prompt, args, async_)
    try:
        pids = [os.getpid(), *getattr(engine.executor, "pids", [])]
        timings = None
        if hasattr(engine.executor, "timings"):  # worker processes: each rank's step, timed
            timings = engine.executor.timings = []
        params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
        rid = engine.add_request(prompt, params)
        c0, t0 = _cpu(pids), time.perf_counter()
        prefill = None
        decode_wall: list[float] = []
        out = None
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            done = engine.step()
            s1 = time.perf_counter()
            progress = engine.progress(rid)
            produced = len(progress.output_ids) if progress is not None else args.new
            if prefill is None and produced >= 1:
                prefill, c1 = s1 - t0, _cpu(pids)
            elif prefill is not None:
                decode_wall.append(s1 - s0)
            for o in done:
                out = o
        c2 = _cpu(pids)
        assert out is not None and prefill is not None
        # the ranks' own decode steps (runner.execute in the worker; what it does while
        # it waits for the driver is not in them): medians per rank, the busiest rank's
        rank_wall = rank_cpu = 0.0
        if timings:
            steps = sorted({t[0] for t in timings})[-len(decode_wall) :]
            per_rank: dict[int, list[tuple[float, float]]] = {}
            for step_id, rank, wall, cpu in timings:
                if step_id in steps:
                    per_rank.setdefault(rank, []).append((wall, cpu))
            rank_wall = max(statistics.median(w for w, _ in v) for v in per_rank.values())
            rank_cpu = max(statistics.median(c for _, c in v) for v in per_rank.values())
        return {
            "prefill": prefill,
            "prefill_cpu": _phase(c0, c1),
            "tpot": statistics.median(decode_wall),
            # the mean over decode steps: the process clocks tick every 10 ms
            "tpot_cpu": _phase(c1, c2, len(decode_wall)),
            "rank_step": {"wall": rank_wall, "cpu": rank_cpu},
            "tokens": list(out.outputs[0].token_ids),
            "in_flight": engine.stats.max_in_flight,
        }
    finally:
        engine.shutdown()


def _rank_steps(
    rank: int, world: int, init: str, args: argparse.Namespace, shm: bool, mode: str = "plain"
) -> dict:
    """Decode steps of one rank at the end of an ``args.context``-token sequence.

    ``mode``: ``"plain"`` (no row sampled), ``"sync"`` (the row sampled
    greedily) or ``"async"`` (sampled, and each step's token id is
    ``PENDING_TOKEN``: the runner keeps the last sampled token, which the
    sampling rank broadcasts to the others, as under async scheduling).
    """
    from medha_parallel import KVPCommunicator, ParallelLayout, ParallelState
    from medha_runtime.plan import PlannedChunk, StepPlan
    from medha_runtime.runner import ModelRunner, RunnerSpec
    from medha_runtime.sampling_params import SampleSpec
    from medha_sched.output import PENDING_TOKEN

    torch.set_num_threads(1)
    group = -(-args.context // world // args.block) * args.block
    spec = RunnerSpec(
        model="tiny",
        dtype="float32",
        device="cpu",
        kvp=world,
        num_blocks=group // args.block + 1,
        block_size=args.block,
        group_tokens=group,
        attention_backend=args.backend,
        pending_tokens=mode == "async",
    )
    state = None
    if world > 1:
        layout = ParallelLayout(kvp=world)
        state = ParallelState.initialize(
            layout, init_method=init, rank=rank, world_size=world, device="cpu"
        )
    runner = ModelRunner(spec, state)
    if runner.attention is not None:
        runner.attention.comm = KVPCommunicator(state, shared_memory=shm)
    groups = tuple(range(world))
    blocks = tuple((g, tuple(range(group // args.block))) for g in groups)
    pos = args.context - 1
    sample = None if mode == "plain" else SampleSpec("a", 0.0, 0, 1.0, 0, None)
    runner.execute(StepPlan(0, (PlannedChunk("a", pos, (7,), groups, blocks, sample),)))
    token = (PENDING_TOKEN if mode == "async" else 7,)
    step = StepPlan(1, (PlannedChunk("a", pos, token, groups, (), sample),))
    wall, cpu = [], []
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.thread_time()
        runner.execute(step)
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}


def _merges(rank: int, world: int, init: str, steps: int, shm: bool, peer_s: float) -> dict:
    """Median wall and CPU time of one decode-sized merge on this rank."""
    from medha_parallel import KVPCommunicator, ParallelLayout, ParallelState

    state = ParallelState.initialize(
        ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
    )
    comm = KVPCommunicator(state, shared_memory=shm)
    out, lse = torch.randn(1, 4, 16), torch.randn(1, 4)
    for _ in range(20):
        comm.merge(out, lse, active=world)
    wall, cpu = [], []
    for _ in range(steps):
        if rank == world - 1:  # the last rank computes peer_s first: the others wait
            t = time.perf_counter()
            while time.perf_counter() - t < peer_s:
                pass
        t, c = time.perf_counter(), time.thread_time()
        comm.merge(out, lse, active=world)
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    assert comm.uses_shared_memory == shm
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}


def merges(args: argparse.Namespace) -> None:
    """``--merge``: one decode-sized merge, shared memory against gloo."""
    print(f"load average before: {os.getloadavg()}")
    peer = args.peer_ms / 1e3
    runs = {
        name: launch(_merges, 2, 10 * args.steps, shm, peer)
        for name, shm in (("shm", True), ("gloo", False))
    }
    print(f"load average after: {os.getloadavg()}")
    print(
        f"\none KVP merge of a [1, 4, 16] state, 2 ranks, medians of {10 * args.steps}; "
        f"rank 1 computes {args.peer_ms} ms before each"
    )
    for name, per_rank in runs.items():
        for r, res in enumerate(per_rank):
            print(
                f"{name:>5} r{r}: wall {1e6 * res['wall']:7.1f} us, CPU {1e6 * res['cpu']:7.1f} us"
            )
    ratio = statistics.median(r["wall"] for r in runs["gloo"]) / statistics.median(
        r["wall"] for r in runs["shm"]
    )
    print(f"gloo / shm wall: {ratio:.1f}x")


def ranks(args: argparse.Namespace) -> None:
    """``--ranks``: decode steps of the ranks alone, kvp=1 against kvp=2 (two transports)."""
    print(f"load average before: {os.getloadavg()}")
    if args.modes == ["sync"]:  # as before: the step samples nothing
        runs = {"kvp=1": launch(_rank_steps, 1, args, False)}
        runs["kvp=2 shm merge"] = launch(_rank_steps, 2, args, True)
        runs["kvp=2 gloo merge"] = launch(_rank_steps, 2, args, False)
    else:  # the row sampled; alternating modes, the shared-memory merge
        runs = {}
        for mode in dict.fromkeys(args.modes):
            runs[f"{mode} kvp=1"] = launch(_rank_steps, 1, args, False, mode)
            runs[f"{mode} kvp=2"] = launch(_rank_steps, 2, args, True, mode)
    print(f"load average after: {os.getloadavg()}")
    base = next(iter(runs.values()))[0]
    print(f"\none decode step at {args.context} tokens, {args.steps} steps, medians per rank")
    print(f"{'':>18} {'wall ms':>8} {'x kvp=1':>8} {'CPU ms':>8} {'x kvp=1':>8}")
    for name, per_rank in runs.items():
        for r, res in enumerate(per_rank):
            w, c = res["wall"], res["cpu"]
            print(
                f"{name + f' r{r}':>18} {1e3 * w:8.2f} {w / base['wall']:8.2f} "
                f"{1e3 * c:8.2f} {c / base['cpu']:8.2f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="output tokens (decode steps + 1)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens")
    ap.add_argument("--block", type=int, default=16, help="KV block size")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", default="auto", help="medha_kernels attention backend")
    ap.add_argument("--kvp", type=int, default=2, help="the KVP degree compared with 1")
    ap.add_argument("--ranks", action="store_true", help="time the ranks alone (see above)")
    ap.add_argument("--merge", action="store_true", help="time one merge (see above)")
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed with --ranks")
    ap.add_argument("--peer-ms", type=float, default=0.0, help="--merge: rank 1 arrives late")
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=("sync", "async"),
        default=["sync"],
        help="scheduling modes, run side by side (async: async scheduling)",
    )
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="W",
        help="both layouts alive together, decode steps in alternating windows of W (see above)",
    )
    args = ap.parse_args()
    if args.interleave < 0:
        ap.error(f"--interleave must be >= 0, got {args.interleave}")
    if args.interleave:
        rng = random.Random(0)
        report_interleaved(args, [rng.randrange(256) for _ in range(args.context)])
        return
    if args.ranks:
        ranks(args)
        return
    if args.merge:
        merges(args)
        return
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(args.context)]
    print(f"load average before: {os.getloadavg()}")
    k = args.kvp
    modes = list(dict.fromkeys(args.modes))
    results: dict[tuple[str, int], list[dict]] = {(m, kvp): [] for m in modes for kvp in (1, k)}
    for rep in range(args.repeats):
        for mode in modes:
            for kvp in (1, k):
                r = run(kvp, prompt, args, mode == "async")
                results[mode, kvp].append(r)
                print(
                    f"repeat {rep} {mode} kvp={kvp}: prefill {r['prefill']:.2f} s "
                    f"(CPU path {r['prefill_cpu']['path']:.2f} s), "
                    f"TPOT {1e3 * r['tpot']:.2f} ms "
                    f"(CPU path {1e3 * r['tpot_cpu']['path']:.2f} ms; rank step "
                    f"{1e3 * r['rank_step']['wall']:.2f} ms, "
                    f"CPU {1e3 * r['rank_step']['cpu']:.2f}), "
                    f"batches in flight at most {r['in_flight']}, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()}")
    tokens = results[modes[0], 1][0]["tokens"]
    same = {key: all(r["tokens"] == tokens for r in rs) for key, rs in results.items()}

    def med(key: tuple[str, int], field: str, sub: str | None = None) -> float:
        rs = results[key]
        return statistics.median(r[field] if sub is None else r[field][sub] for r in rs)

    rows = [
        ("prefill wall (s)", 1.0, "prefill", None),
        ("prefill CPU path (s)", 1.0, "prefill_cpu", "path"),
        ("prefill CPU total (s)", 1.0, "prefill_cpu", "total"),
        ("TPOT wall (ms)", 1e3, "tpot", None),
        ("TPOT CPU path (ms)", 1e3, "tpot_cpu", "path"),
        ("TPOT CPU total (ms)", 1e3, "tpot_cpu", "total"),
        ("TPOT CPU driver (ms)", 1e3, "tpot_cpu", "driver"),
        ("TPOT CPU worker (ms)", 1e3, "tpot_cpu", "worker"),
        ("rank step wall (ms)", 1e3, "rank_step", "wall"),
        ("rank step CPU (ms)", 1e3, "rank_step", "cpu"),
    ]
    print(f"\ncontext {args.context}, {args.new} new tokens, chunk {args.chunk}, 1 thread per rank")
    head = f"{'median of ' + str(args.repeats):>24}"
    for mode in modes:
        head += f" {mode + ' kvp=1':>12} {f'{mode} kvp={k}':>12} {f'{k}/1':>6}"
    if len(modes) > 1:
        head += f" {'async/sync kvp=1':>16} {f'kvp={k}':>7}"
    print(head)
    for name, scale, field, sub in rows:
        line = f"{name:>24}"
        for mode in modes:
            a, b = med((mode, 1), field, sub), med((mode, k), field, sub)
            ratio = f"{b / a:6.2f}" if a else f"{'-':>6}"
            line += f" {scale * a:12.2f} {scale * b:12.2f} {ratio}"
        if len(modes) > 1:
            for kvp, width in ((1, 16), (k, 7)):
                s_, a_ = med((modes[0], kvp), field, sub), med((modes[-1], kvp), field, sub)
                line += f" {a_ / s_:{width}.2f}" if s_ else f" {'-':>{width}}"
        print(line)
    for (mode, kvp), ok in same.items():
        print(f"greedy tokens identical to {modes[0]} kvp=1: {mode} kvp={kvp} {ok}")
    print(f"greedy tokens identical: {all(same.values())}")


if __name__ == "__main__":
    main()
