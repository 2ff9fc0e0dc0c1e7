"""End-to-end convoy benchmark: do long prompts stall short chats on the real server?

On this machine's CPU with the built-in ``tiny`` model, one trace of
chat-sized short requests plus a few long prompts (tens of thousands of
tokens) arriving at a steady rate is replayed with ``medha-runtime bench``
against three servers:

- ``lars-mp``: Medha's scheduler (adaptive chunks, space sharing);
- ``fcfs@CHUNK``: FCFS with a fixed chunk (Sarathi-style);
- ``fcfs@0``: FCFS without chunking (non-preemptive prefill).

The trace holds as many long prompts as make their prefills, each run in one
step as the profile predicts it, ``--long-share`` (25%) of its duration
(``--long-count`` fixes the number instead). So the convoy FCFS builds reaches
the short requests' P90 on a fast machine as on a slow one: with a fixed count
of 3, a machine that prefilled them in 4.7 s delayed only 16 of 160 short
requests, and their P90 missed the convoy.

Before the trace, each server gets a probe: a dozen short requests, one at
a time. Their client TTFT minus their steps' executor time is the time the
simulator does not see (HTTP, tokenisation, IPC, streaming back); its
median goes to ``medha-sim run --admission-delay``.

The profile and the servers run torch on ``--engine-threads`` threads
(default 1). On two cores a two-thread engine stalls whenever the HTTP
front end or the load generator takes a core, so served steps ran 1.1-1.3x
the profile; with one thread they keep the other core.

Every server and the simulator use one cost model profiled on this machine
(``medha-runtime profile tiny``). The same trace then goes through
``medha-sim run`` with that profile; simulated short-request P50/P90 TTFT
are put beside the measured ones.

    python benchmarks/convoy.py --out /tmp/convoy            # about 7 minutes
    python benchmarks/convoy.py --out /tmp/convoy --profile PROFILE.json

Prints a Markdown report (also written to OUT/report.md) with the targets:
lars-mp's short P90 TTFT >= 10x lower than fcfs@0 and >= 3x lower than
fcfs@CHUNK, its P90 TPOT <= 1.5 x the target batch time, its throughput
within 10% of FCFS's, and the simulator within 25% of the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from medha_runtime.server.launch import LaunchError, ServerProcess, start_server, stop_server
from medha_runtime.step_log import check_predictions, read_step_log, step_overheads
from medha_sched import TableCostModel
from medha_sched.cost.base import BatchWork
from medha_sched.sim.metrics import percentile, read_requests

PY = sys.executable


def sh(cmd: list[str], log: Path, *, env: dict[str, str] | None = None) -> None:
    print("$ " + shlex.join(cmd), flush=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}); see {log}")


def _csv(values: set[int]) -> str:
    return ",".join(map(str, sorted(values)))


def long_count(args: argparse.Namespace, profile: Path) -> tuple[int, float]:
    """``(count, seconds)``: how many long prompts the trace holds, and the profile's
    prediction of one long prompt's prefill in a single step (as ``fcfs@0`` runs it).

    ``--long-count`` when given; otherwise as many as make the long prefills, run
    whole, ``--long-share`` of the trace's duration (at least one). The short
    requests that arrive during a long prefill are the ones a convoy delays; with a
    fixed count, a faster machine shortens the prefills until fewer than 10% of the
    short requests meet one, and their P90 TTFT no longer sees the convoy at all
    (3 prompts of 24,576 tokens at 4.7 s each delayed 16 of 160 on a faster VM).
    """
    seconds = TableCostModel.from_json(profile).predict(
        BatchWork.single_group((args.long_tokens, 0))
    )
    if args.long_count is not None:
        return args.long_count, seconds
    return max(1, round(args.long_share * args.duration / seconds)), seconds


def make_trace(args: argparse.Namespace, path: Path) -> None:
    """Poisson short chats plus ``args.long_count`` long prompts at a steady rate."""
    rng = random.Random(args.seed)
    rows, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(args.short_qps)
        if t >= args.duration:
            break
        prompt = rng.randint(args.short_prompt[0], args.short_prompt[1])
        output = rng.randint(args.short_output[0], args.short_output[1])
        rows.append(
            {
                "id": f"s{i:04d}",
                "arrival_s": round(t, 6),
                "prompt_tokens": prompt,
                "output_tokens": output,
            }
        )
        i += 1
    gap = args.duration / args.long_count
    for k in range(args.long_count):
        rows.append(
            {
                "id": f"L{k}",
                "arrival_s": round(gap * (k + 0.25), 6),
                "prompt_tokens": args.long_tokens,
                "output_tokens": args.long_output,
            }
        )
    rows.sort(key=lambda r: r["arrival_s"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    shorts = sum(1 for r in rows if r["id"].startswith("s"))
    print(f"trace: {shorts} short + {args.long_count} long over {args.duration:.0f} s -> {path}")


PROBE_REQUESTS = 12


def make_probe(path: Path) -> None:
    """Short prompts one at a time (0.5 s apart), one output token each."""
    rows = [
        {"id": f"p{i:02d}", "arrival_s": 0.5 * i, "prompt_tokens": 64 + 29 * i, "output_tokens": 1}
        for i in range(PROBE_REQUESTS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def admission_delay(probe_result: Path, steps: Path) -> float:
    """Median of (client TTFT - executor time) over the probe's requests.

    The probe ran first on an idle server, one request at a time, so the step
    log's first records are its prefills, in order.
    """
    reqs = sorted(json.loads(probe_result.read_text())["requests"], key=lambda r: r["id"])
    records = read_step_log(steps)[: len(reqs)]
    if any(r.get("error") for r in reqs) or len(records) < len(reqs):
        sys.exit(f"the probe failed; see {probe_result}")
    gaps = []
    for req, rec in zip(reqs, records, strict=True):
        if list(rec.items) != [(req["prompt_tokens"], 0)]:
            sys.exit(f"probe step {rec.step} is {rec.items}, not {req['id']}'s prefill alone")
        gaps.append(req["ttft_s"] - rec.execute_s)
    return statistics.median(gaps)


def _threads(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}")
    return value


def engine_env(threads: int) -> dict[str, str]:
    """The environment of the profile and the servers: ``threads`` torch threads."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def start_tiny(flags: list[str], log: Path, env: dict[str, str]) -> ServerProcess:
    """``serve tiny`` with ``flags``; exits the benchmark if it cannot start."""
    print("$ medha-runtime serve tiny " + shlex.join(flags), flush=True)
    try:
        return start_server("tiny", flags, log=log, env=env, timeout_s=300)
    except LaunchError as exc:
        sys.exit(str(exc))


def bench(url: str, trace: Path, result: Path, log: Path) -> None:
    """Replay ``trace`` against the server at ``url`` with ``medha-runtime bench``."""
    sh(
        [
            PY,
            "-m",
            "medha_runtime",
            "bench",
            "--base-url",
            url,
            "--dataset-name",
            "trace",
            "--dataset-path",
            str(trace),
            "--no-slo-fields",
            "--no-progress",
            "--request-timeout",
            "600",
            "--long-threshold",
            "8192",
            "--result-file",
            str(result),
        ],
        log,
    )


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (numpy's linear interpolation); NaN when empty."""
    value = percentile(values, q)
    return float("nan") if value is None else value


def measured(result: Path) -> dict[str, float]:
    doc = json.loads(result.read_text())
    reqs = doc["requests"]
    failed = [r for r in reqs if r.get("error")]
    ok = [r for r in reqs if not r.get("error")]
    short = [r for r in ok if r["id"].startswith("s")]
    tpots = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    start = min(r["start_s"] for r in reqs)
    end = max(r["start_s"] + r["e2e_s"] for r in ok)
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in ok)
    return {
        "requests": len(reqs),
        "failed": len(failed),
        "ttft_p50_short": pct([r["ttft_s"] for r in short], 50),
        "ttft_p90_short": pct([r["ttft_s"] for r in short], 90),
        "tpot_p90": pct(tpots, 90),
        "tokens_per_s": tokens / (end - start),
    }


def simulated(run_dir: Path) -> dict[str, float]:
    rows = read_requests(run_dir / "requests.jsonl")
    short = [r["ttft_s"] for r in rows if r["id"].startswith("s") and r["ttft_s"] is not None]
    tpots = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    return {
        "ttft_p50_short": pct(short, 50),
        "ttft_p90_short": pct(short, 90),
        "tpot_p90": pct(tpots, 90),
    }


def step_check(steps: Path, profile: Path) -> dict[str, float]:
    """The server's step log against the profile: executor time, predicted time, overhead.

    The whole log: the probe's steps (a dozen short prefills) are counted too.
    """
    records = read_step_log(steps)
    check = check_predictions(TableCostModel.from_json(profile), records)
    return {
        "steps": check.steps,
        "execute_s": check.measured_s,
        "predicted_s": check.predicted_s,
        "median_ratio": check.median_ratio,
        "overhead_ms": 1e3 * step_overheads(records).median_s,
    }


def variants(chunk: int) -> list[tuple[str, list[str]]]:
    """(label, policy flags), the same for ``serve`` and ``medha-sim run``."""
    return [
        ("lars-mp", ["--policy", "lars-mp"]),
        (f"fcfs@{chunk}", ["--policy", "fcfs", "--chunk-size", str(chunk)]),
        ("fcfs@0", ["--policy", "fcfs", "--chunk-size", "0"]),
    ]


def report(args: argparse.Namespace, rows: dict[str, dict], sims: dict[str, dict]) -> str:
    T = args.target_batch_time
    lines = [
        f"Trace: {args.duration:.0f} s of short chats at {args.short_qps} QPS "
        f"(prompts {args.short_prompt[0]}-{args.short_prompt[1]}, outputs "
        f"{args.short_output[0]}-{args.short_output[1]} tokens) plus {args.long_count} prompts "
        f"of {args.long_tokens} tokens (each {args.long_seconds:.2f} s in one step by the "
        f"profile: {args.long_count * args.long_seconds / args.duration:.0%} of the trace); "
        f"target batch time {T} s; {args.engine_threads} engine thread(s).",
        "",
        "| run | requests | failed | short P50 TTFT | short P90 TTFT | P90 TPOT | tokens/s |"
        " sim short P50 | sim short P90 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, m in rows.items():
        s = sims.get(label, {})
        lines.append(
            f"| {label} | {m['requests']} | {m['failed']} | {m['ttft_p50_short']:.3f} s | "
            f"{m['ttft_p90_short']:.3f} s | {m['tpot_p90'] * 1e3:.0f} ms | "
            f"{m['tokens_per_s']:.0f} | {s.get('ttft_p50_short', float('nan')):.3f} s | "
            f"{s.get('ttft_p90_short', float('nan')):.3f} s |"
        )
    ours = rows["lars-mp"]
    chunked = rows[f"fcfs@{args.chunk_size}"]
    whole = rows["fcfs@0"]
    checks = [
        (
            "short P90 TTFT vs fcfs@0 (>= 10x)",
            whole["ttft_p90_short"] / ours["ttft_p90_short"],
            10.0,
            True,
        ),
        (
            f"short P90 TTFT vs fcfs@{args.chunk_size} (>= 3x)",
            chunked["ttft_p90_short"] / ours["ttft_p90_short"],
            3.0,
            True,
        ),
        ("P90 TPOT / target batch time (<= 1.5)", ours["tpot_p90"] / T, 1.5, False),
        (
            f"throughput / fcfs@{args.chunk_size} (>= 0.9)",
            ours["tokens_per_s"] / chunked["tokens_per_s"],
            0.9,
            True,
        ),
    ]
    for label, m in rows.items():
        s = sims.get(label)
        for key in ("ttft_p50_short", "ttft_p90_short"):
            if s:
                err = abs(s[key] - m[key]) / m[key]
                checks.append((f"sim {label} {key} error (<= 25%)", err, 0.25, False))
    lines += [
        "",
        "| run | steps | executor time | profile's prediction | median step ratio |"
        " overhead per step | admission delay (probe) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, m in rows.items():
        c = m["steps"]
        lines.append(
            f"| {label} | {c['steps']} | {c['execute_s']:.1f} s | {c['predicted_s']:.1f} s | "
            f"{c['median_ratio']:.2f} | {c['overhead_ms']:.2f} ms | "
            f"{m['admission_delay_s'] * 1e3:.1f} ms |"
        )
    lines += ["", "| check | value | target | met |", "|---|---:|---:|---|"]
    for name, value, target, at_least in checks:
        met = value >= target if at_least else value <= target
        lines.append(f"| {name} | {value:.2f} | {target:g} | {'yes' if met else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", type=Path, default=None, help="reuse a tiny-model profile")
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--short-qps", type=float, default=2.0)
    p.add_argument("--short-prompt", type=int, nargs=2, default=[64, 384])
    p.add_argument("--short-output", type=int, nargs=2, default=[16, 32])
    p.add_argument(
        "--long-count",
        type=_threads,
        default=None,
        help="long prompts in the trace (default: from --long-share and the profile)",
    )
    p.add_argument(
        "--long-share",
        type=_share,
        default=0.25,
        help="without --long-count: the long prompts' whole-prompt prefills, as the profile "
        "predicts them, take this share of --duration (default 0.25)",
    )
    p.add_argument("--long-tokens", type=int, default=24576)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--target-batch-time", type=float, default=0.1)
    p.add_argument("--kv-cache-tokens", type=int, default=262144)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine-threads",
        type=_threads,
        default=1,
        help="torch threads of the profile and the servers (OMP_NUM_THREADS; default 1: on "
        "2 cores the other is left to the HTTP front end and the load generator)",
    )
    p.add_argument("--only", default=None, help="comma-separated run labels to do")
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    probe = out / "probe.jsonl"
    make_probe(probe)
    profile = args.profile
    if profile is None:
        profile = out / "profile.json"
        sh(
            [
                PY,
                "-m",
                "medha_runtime",
                "profile",
                "tiny",
                "--out",
                str(profile),
                "--repeats",
                "5",
                # the workload's shapes: chunks up to fcfs's and lars-mp's, KV up to a long prompt
                "--prefill-q",
                _csv({1, 16, 32, 64, 96, 128, 192, 256, 384, 1024, args.chunk_size or 1}),
                "--prefill-kv",
                _csv({0, 1024, 2048, 4096, 8192, 16384, args.long_tokens}),
            ],
            out / "profile.log",
            env=engine_env(args.engine_threads),
        )
    args.long_count, args.long_seconds = long_count(args, profile)
    make_trace(args, trace)
    common = [
        "--cost-model",
        f"table:{profile}",
        "--target-batch-time",
        str(args.target_batch_time),
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
    ]
    rows, sims = {}, {}
    only = set(args.only.split(",")) if args.only else None
    for label, policy_flags in variants(args.chunk_size):
        if only and label not in only:
            continue
        server = start_tiny(
            [
                *policy_flags,
                *common,
                "--max-model-len",
                "32768",
                "--log-level",
                "warning",
                "--step-log",
                str(out / f"{label}.steps.jsonl"),
            ],
            out / f"{label}.server.log",
            engine_env(args.engine_threads),
        )
        try:
            bench(server.url, probe, out / f"{label}.probe.json", out / f"{label}.probe.log")
            result = out / f"{label}.bench.json"
            bench(server.url, trace, result, out / f"{label}.bench.log")
        finally:
            stop_server(server)
        rows[label] = measured(result)
        rows[label]["steps"] = step_check(out / f"{label}.steps.jsonl", profile)
        delay = admission_delay(out / f"{label}.probe.json", out / f"{label}.steps.jsonl")
        rows[label]["admission_delay_s"] = delay
        sim_dir = out / f"{label}.sim"
        sh(
            [
                PY,
                "-m",
                "medha_sched.sim.cli",
                "run",
                "--trace",
                str(trace),
                *policy_flags,
                *common,
                "--admission-delay",
                f"{delay:.6f}",
                "--out",
                str(sim_dir),
                "--quiet",
            ],
            out / f"{label}.sim.log",
        )
        sims[label] = simulated(sim_dir)
        print(label, rows[label], sims[label], flush=True)
    if len(rows) == 3:
        text = report(args, rows, sims)
        (out / "report.md").write_text(text, encoding="utf-8")
        print(text)


if __name__ == "__main__":
    main()
