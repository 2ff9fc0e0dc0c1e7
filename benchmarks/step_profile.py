"""Where a decode step's time goes: wall per step, a torch.profiler table, host syncs, launches.

Builds ``medha_runtime.LLM`` (one rank, in this process), runs one warm-up
generate, then ``--batch`` prompts of ``--prompt-len`` random token ids for
``--new`` tokens each (greedy, EOS ignored) twice: once timed, once under
``torch.profiler`` (CPU, plus CUDA on ``--device cuda``). The engine is driven
step by step (``engine.step()``, as ``LLM.generate`` does); a step is a
*decode step* when every request already has a token before it (no prefill
left), and each decode step is marked ``medha::decode_step`` in the profile.
The profiled runs execute the model in the calling thread (the profiler does
not see the executor's model thread), so their steps lack the driver/model
overlap of the timed run.

Printed: wall per decode step and per new token (total / N), tokens/s; the
profiler's ``key_averages()`` by self CUDA time and by self CPU time (top 25);
per decode step, the host-sync calls (``cudaStreamSynchronize``, ``cudaMemcpy*``,
DtoH copies on the GPU, ``aten::item``, ``aten::_local_scalar_dense``,
``aten::nonzero``), the kernel launches (``cudaLaunchKernel*`` + ``cuLaunchKernel*``)
and the ``aten::`` ops; on CUDA, the GPU busy time (sum of kernel durations) per
decode step against its wall. Then (unless ``--no-stacks``) one more profiled
run ``with_stack``: the Python call sites in Medha of every sync-prone call
(``.item()``, ``nonzero``, synchronize, memcpy). ``--json PATH`` writes these numbers.

    python3 benchmarks/step_profile.py --model tiny --device cpu --new 8 --batch 4 --prompt-len 64
    python3 benchmarks/step_profile.py --model random:benchmarks/models/llama3-8b-1m \\
        --device cuda --dtype bfloat16 --batch 8 --prompt-len 512 --new 32 --json $OUT/sp.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import time
from collections import Counter
from typing import Any

import torch

MARK = "medha::decode_step"
SYNC_NAMES = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::to",
    "aten::copy_",
)
LAUNCH_PREFIXES = ("cudaLaunchKernel", "cuLaunchKernel")


def make_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # a new seed per run: no prefix-cache hits across runs
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(batch)]


def run(
    llm: Any, prompts: list[list[int]], new: int, sync: Any, mark: bool, each: bool = True
) -> dict[str, Any]:
    """Generate; the wall of every decode step and the whole (seconds). With ``each``
    the device is synchronized after every step (the profiled runs: each marked step
    holds its own kernels); without it only at the end (the timed run: with async
    scheduling a step returns while the next batch runs, as in serving)."""
    from medha_runtime import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, Any] = {}
    decode_walls: list[float] = []
    steps = 0
    while len(done) < len(rids):
        pending = [r for r in rids if r not in done]
        progress = [engine.progress(r) for r in pending]
        decode = all(p is not None and len(p.output_ids) >= 1 for p in progress)
        s0 = time.perf_counter()
        if decode and mark:
            with torch.profiler.record_function(MARK):
                outs = engine.step()
                sync()
        else:
            outs = engine.step()
            if each:
                sync()
        if decode:
            decode_walls.append(time.perf_counter() - s0)
        steps += 1
        for out in outs:
            done[out.request_id] = out
    sync()
    total = time.perf_counter() - t0
    lens = [len(done[r].outputs[0].token_ids) for r in rids]
    if any(n != new for n in lens):
        raise RuntimeError(f"expected {new} tokens per request, got {lens}")
    return {"total_s": total, "steps": steps, "decode_walls": decode_walls}


def model_in_this_thread(llm: Any) -> Any:
    """Run the model in the caller's thread (torch.profiler records only the threads it
    was started in, and the in-process executor's model thread predates it); returns
    the undo."""
    ex = llm.engine.executor
    if not all(hasattr(ex, a) for a in ("runner", "_results", "_submitted", "_check_usable")):
        raise RuntimeError(f"{type(ex).__name__} is not the in-process executor this script knows")

    def submit(plan: Any) -> None:
        ex._check_usable()
        ex._submitted += 1
        t = time.perf_counter()
        try:
            result = ex.runner.execute(plan)
        except BaseException as exc:  # next_event raises it, as the model thread's would be
            ex._results.put((plan.step_id, None, exc, 0.0))
        else:
            ex._results.put((plan.step_id, result, None, time.perf_counter() - t))

    ex.submit = submit
    return lambda: delattr(ex, "submit")


def _self_key(table_kind: str, cuda: bool) -> str:
    if table_kind == "cpu":
        return "self_cpu_time_total"
    return "self_device_time_total" if cuda else "self_cpu_time_total"


def profile_counts(prof: Any, cuda: bool) -> dict[str, Any]:
    """Per decode step: syncs, launches, aten ops, GPU busy time (from the profiler's events)."""
    events = list(prof.events())
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == MARK)
    n = len(marks)
    out: dict[str, Any] = {"decode_steps_profiled": n}
    if not n:
        return out

    starts = [a for a, _ in marks]

    def inside(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t <= marks[i][1]

    host: Counter[str] = Counter()
    aten = 0
    launches = 0
    kernel_us = 0.0
    kernels = 0
    dtoh = 0
    for e in events:
        start = e.time_range.start
        if not inside(start):
            continue
        dev = str(getattr(e, "device_type", "")).upper()
        if "CUDA" in dev:  # a GPU-side event (kernel, memcpy, memset)
            if "memcpy" in e.name.lower() and "dtoh" in e.name.lower():
                dtoh += 1
            else:
                kernels += 1
            kernel_us += e.time_range.end - start
            continue
        if e.name in SYNC_NAMES:
            host[e.name] += 1
        if e.name.startswith(LAUNCH_PREFIXES):
            launches += 1
        if e.name.startswith("aten::"):
            aten += 1
    out["host_syncs_per_step"] = {k: host[k] / n for k in SYNC_NAMES if host[k]}
    out["aten_ops_per_step"] = aten / n
    if cuda:
        out["launches_per_step"] = launches / n
        out["gpu_kernels_per_step"] = kernels / n
        out["dtoh_copies_per_step"] = dtoh / n
        out["gpu_busy_ms_per_step"] = kernel_us / n / 1e3
    out["marked_wall_ms_per_step"] = sum(b - a for a, b in marks) / n / 1e3
    return out


STACK_OPS = (
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
)


def sync_stacks(prof: Any) -> list[dict[str, Any]]:
    """Print and return the Python call sites of the sync-prone calls (with_stack run):
    each call's enclosing Python frames in Medha's code (the profiler records them as
    parent events, or as the event's ``stack`` in older torch)."""
    print("\n== call sites of sync-prone calls (whole with_stack generate) ==")
    sites: Counter[tuple[str, tuple[str, ...]]] = Counter()
    for e in prof.events():
        if e.name not in STACK_OPS:
            continue
        frames = list(getattr(e, "stack", None) or [])
        parent = getattr(e, "cpu_parent", None)
        while parent is not None and not frames:
            if ".py(" in parent.name:
                frames.append(parent.name)
            parent = parent.cpu_parent
        while parent is not None:
            if ".py(" in parent.name:
                frames.append(parent.name)
            parent = parent.cpu_parent
        ours = [f for f in frames if "medha" in f or "step_profile" in f] or frames
        sites[(e.name, tuple(ours[:6]))] += 1
    rows = [{"op": op, "count": c, "stack": list(st)} for (op, st), c in sites.most_common(30)]
    for r in rows:
        print(f"  {r['count']:6d} x {r['op']}")
        for frame in r["stack"]:
            print(f"           {frame}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, random:<dir>, a directory ...")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 ...")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--chunk-size", type=int, default=None, help="0: whole prompts")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="default: 2 runs' worth")
    parser.add_argument("--top", type=int, default=25, help="rows of each profiler table")
    parser.add_argument(
        "--no-stacks", action="store_true", help="skip the with_stack run (sync call sites)"
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the engine schedules one batch ahead (the timed run; the profiled runs "
        "execute each step in this thread, so they are synchronous either way)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps replayed from CUDA graphs (default: the engine's, on with CUDA)",
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="only the timed run (no torch.profiler runs)"
    )
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args()
    for name in ("batch", "prompt_len", "new"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")

    from medha_runtime import LLM

    per_req = -(-(args.prompt_len + args.new + 16) // 16) * 16
    kv = args.kv_cache_tokens or 2 * args.batch * per_req
    kwargs: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "kv_cache_tokens": kv,
        "max_model_len": per_req,
        "async_scheduling": args.async_scheduling,
        "cuda_graphs": args.cuda_graphs,
    }
    if args.threads is not None:
        kwargs["num_threads"] = args.threads
    if args.chunk_size is not None:
        kwargs["chunk_size"] = args.chunk_size
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    t_load = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    load_s = time.perf_counter() - t_load
    print(f"{llm!r}; built in {load_s:.1f} s; kv_cache_tokens={kv}")
    B, N = args.batch, args.new
    result: dict[str, Any] = {"args": vars(args), "load_s": load_s}
    try:
        run(llm, make_prompts(B, args.prompt_len, 1), N, sync, mark=False)  # warm-up
        timed = run(llm, make_prompts(B, args.prompt_len, 2), N, sync, mark=False, each=False)
        walls = timed["decode_walls"]
        dw = sorted(walls)
        result["timed"] = {
            "total_s": timed["total_s"],
            "steps": timed["steps"],
            "ms_per_new_token_step": timed["total_s"] / N * 1e3,
            "tokens_per_s": B * N / timed["total_s"],
            "decode_steps": len(walls),
            "decode_ms_median": dw[len(dw) // 2] * 1e3 if dw else None,
            "decode_ms_min": dw[0] * 1e3 if dw else None,
            "decode_ms_max": dw[-1] * 1e3 if dw else None,
            "decode_tokens_per_s": B * len(walls) / sum(walls) if walls else None,
        }
        t = result["timed"]
        print(
            f"timed generate: {B} x {N} tokens in {t['total_s']:.3f} s over {t['steps']} steps: "
            f"{t['ms_per_new_token_step']:.2f} ms per new token (total/N), "
            f"{t['tokens_per_s']:.1f} tokens/s"
        )
        if dw:
            print(
                f"decode steps: {len(dw)}, wall median {t['decode_ms_median']:.2f} ms "
                f"(min {t['decode_ms_min']:.2f}, max {t['decode_ms_max']:.2f}), "
                f"{t['decode_tokens_per_s']:.1f} tokens/s"
            )

        if not args.no_profile:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            undo = model_in_this_thread(llm)
            try:
                run(llm, make_prompts(B, args.prompt_len, 3), N, sync, mark=False)  # inline warm-up
                with torch.profiler.profile(activities=acts) as prof:
                    profiled = run(llm, make_prompts(B, args.prompt_len, 4), N, sync, mark=True)
                stacks = None
                if not args.no_stacks:  # a second profiled run: where the sync calls come from
                    with torch.profiler.profile(activities=acts, with_stack=True) as stacks:
                        run(llm, make_prompts(B, args.prompt_len, 5), N, sync, mark=True)
            finally:
                undo()
            result["profiled_total_s"] = profiled["total_s"]
            ka = prof.key_averages()
            tables = [("cuda", "self CUDA")] if cuda else []
            tables.append(("cpu", "self CPU"))
            for kind, label in tables:
                print(f"\n== key_averages by {label} time (top {args.top}), profiled generate ==")
                print(
                    ka.table(
                        sort_by=_self_key(kind, cuda), row_limit=args.top, max_name_column_width=60
                    )
                )
            counts = profile_counts(prof, cuda)
            result["per_decode_step"] = counts
            if stacks is not None:
                result["sync_stacks"] = sync_stacks(stacks)
            print("\n== per decode step (profiled run) ==")
            for k, v in counts.items():
                print(f"  {k}: {json.dumps(v) if isinstance(v, dict) else v}")
            if cuda and "gpu_busy_ms_per_step" in counts and dw:
                busy = counts["gpu_busy_ms_per_step"]
                wall = counts["marked_wall_ms_per_step"]
                print(
                    f"  GPU busy {busy:.2f} ms of {wall:.2f} ms wall per decode step "
                    f"({100 * busy / wall:.0f}%); unprofiled median wall "
                    f"{t['decode_ms_median']:.2f} ms"
                )
    finally:
        llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
