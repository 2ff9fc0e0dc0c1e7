"""Does the iteration budget hold in reality? The online cost model and predictive admission.

Each run starts ``medha-runtime serve tiny`` with default settings (the start-up
calibration seeds the online cost model; no profile) and a step log, then:

- **quiet**: one long prompt (``--long-tokens``, >= 40K in the issue's setup)
  plus a short chat every ``--chat-every`` seconds, streamed, until the long
  request's first token;
- **hog**: the same, with ``--hog-procs`` processes spinning on the CPU from
  halfway through the long prefill (half the quiet run's long TTFT);
- **admission**: a Poisson trace of SLO-carrying requests at ``--overload``
  times the server's prefill capacity (measured in the quiet run), replayed
  against ``--admission reject`` and then ``--admission accept`` (capacity:
  prompts of the trace's mean length, one at a time, on the first server).

Reported, per run, from the step log (steps after the first 50) and the client:
prediction error ``|predicted - measured| / measured`` of the executor time
(median, p90), the share of steps whose executor time exceeded 1.25 T, the
short chats' inter-token latency while the long prompt prefilled (p90), their
TTFT (p90), with the hog how many steps the model needed to adapt (from the
hog's start to the first 10-step window whose median error is under 10%),
and for admission: accepted/rejected, the share of accepted requests that met
their SLO, and how fast a 429 came back: as the client saw it, from the call
(which includes waiting for a pooled connection and this process's own busy
event loop) and from the request's first byte written to its status read, and
as the server measured it (``medha:admission_reject_seconds``: from the
request's arrival in the ASGI app to the 429 sent).

    python benchmarks/budget.py --out /tmp/budget                   # issue setup
    python benchmarks/budget.py --out /tmp/budget --long-tokens 8192 # a shorter run
    python benchmarks/budget.py --out /tmp/budget --runs quiet --layout "--spp 2"  # worker ranks

Prints a Markdown report (also OUT/report.md) and writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from medha_runtime.bench.server_metrics import ErrorHistogram
from medha_runtime.server.launch import LaunchError, ServerProcess, start_server, stop_server
from medha_runtime.step_log import StepRecord, read_step_log

PY = sys.executable
VOCAB = 250  # tiny's vocabulary has 259 ids; stay below the special ones


def start_tiny(flags: list[str], log: Path, threads: int, layout: str = "") -> ServerProcess:
    """``serve tiny`` with ``threads`` torch threads (per rank) and the ``--layout`` flags
    (e.g. ``"--spp 2"``); exits the benchmark if it cannot start."""
    flags = [*flags, *shlex.split(layout)]
    print("$ medha-runtime serve tiny " + " ".join(flags), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        return start_server("tiny", flags, log=log, env=env, timeout_s=600)
    except LaunchError as exc:
        sys.exit(str(exc))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


# ------------------------------------------------------------------ client
def completion_body(prompt: list[int], max_tokens: int, slo_ms: float | None) -> bytes:
    """A streamed completion request's JSON body."""
    body: dict = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    if slo_ms is not None:
        body["ttft_slo_ms"] = slo_ms
    return json.dumps(body).encode()


async def stream_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, slo_ms: float | None
) -> dict:
    """One streamed completion: send time, token arrival times, or a rejection."""
    return await send_request(
        client, url, completion_body(prompt, max_tokens, slo_ms), len(prompt), slo_ms
    )


async def send_request(
    client: httpx.AsyncClient, url: str, body: bytes, prompt_len: int, slo_ms: float | None
) -> dict:
    """Send a prepared body (see :func:`completion_body`).

    Times: ``sent`` when called, ``written`` when the connection starts writing
    the request (after the pool gave one), ``status_at`` when the response's
    headers have been read, ``answered`` (a rejection) once its body is read;
    ``tokens``: each token's arrival.
    """
    rec: dict = {"sent": time.monotonic(), "tokens": [], "prompt": prompt_len, "slo_ms": slo_ms}

    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_headers.started":
            rec["written"] = time.monotonic()
        elif event == "http11.receive_response_headers.complete":
            rec["status_at"] = time.monotonic()

    headers = {"Content-Type": "application/json"}
    async with client.stream(
        "POST",
        f"{url}/v1/completions",
        content=body,
        headers=headers,
        extensions={"trace": trace},
    ) as r:
        if r.status_code != 200:
            rec["status"] = r.status_code
            rec["answered"] = time.monotonic()
            rec["error"] = json.loads(await r.aread()).get("error", {})
            rec["retry_after"] = r.headers.get("Retry-After")
            return rec
        rec["status"] = 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    rec["tokens"].append(time.monotonic())
    return rec


def prompt_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


async def long_and_chats(args: argparse.Namespace, url: str, hog_after: float | None) -> dict:
    """The long prompt plus a chat every ``chat_every`` s until its first token."""
    rng = random.Random(args.seed)
    hog: list[subprocess.Popen] = []
    hog_at = None
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        chats: list[asyncio.Task] = []
        t0 = time.monotonic()
        long_task = asyncio.create_task(
            stream_request(client, url, prompt_of(rng, args.long_tokens), 4, None)
        )
        while not long_task.done():
            chats.append(
                asyncio.create_task(
                    stream_request(
                        client, url, prompt_of(rng, args.chat_prompt), args.chat_output, None
                    )
                )
            )
            if hog_after is not None and hog_at is None and time.monotonic() - t0 >= hog_after:
                hog_at = time.monotonic()
                spin = "while True: pass"
                hog = [subprocess.Popen([PY, "-c", spin]) for _ in range(args.hog_procs)]
                print(f"  CPU hog ({args.hog_procs} procs) started at {hog_at - t0:.1f} s")
            await asyncio.sleep(args.chat_every)
        long = await long_task
        done = await asyncio.gather(*chats)
    for p in hog:
        p.kill()
        p.wait()
    return {"t0": t0, "long": long, "chats": done, "hog_at": hog_at}


async def replay(args: argparse.Namespace, url: str, trace: list[dict]) -> list[dict]:
    rng = random.Random(args.seed + 1)
    # every body made before the clock starts: drawing and encoding 2,048 tokens takes
    # the client's event loop ~1 ms, which would delay the other requests' timings
    bodies = [completion_body(prompt_of(rng, row["prompt"]), 4, row["slo_ms"]) for row in trace]
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.monotonic()
        tasks = []
        for row, body in zip(trace, bodies, strict=True):
            delay = t0 + row["at"] - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(send_request(client, url, body, row["prompt"], row["slo_ms"]))
            )
        return await asyncio.gather(*tasks)


# ---------------------------------------------------------------- analysis
def step_stats(steps: list[StepRecord], hog_at: float | None, skip: int = 50) -> dict:
    later = steps[skip:]
    errors = [s.error for s in later]
    over = [s for s in later if s.target_s and s.measured_s > 1.25 * s.target_s]
    out = {
        "steps": len(steps),
        "error_median": statistics.median(errors) if errors else float("nan"),
        "error_p90": pct(errors, 90),
        "steps_over_1.25T": len(over),
        "share_over_1.25T": len(over) / len(later) if later else float("nan"),
        "target_s": steps[-1].target_s if steps else float("nan"),
        # the automatic T follows a learning cost model: where it started, how often it moved
        "target_first_s": steps[0].target_s if steps else float("nan"),
        "target_changes": sum(a.target_s != b.target_s for a, b in itertools.pairwise(steps)),
        "execute_p50_s": statistics.median([s.execute_s for s in later]) if later else 0.0,
    }
    if hog_at is not None:
        after = [s for s in steps if s.monotonic_s >= hog_at]
        before = [s.error for s in steps if s.monotonic_s < hog_at][-50:]
        out["error_median_before_hog"] = statistics.median(before) if before else float("nan")
        adapt = None
        for i in range(len(after) - 9):
            if statistics.median(s.error for s in after[i : i + 10]) < 0.10:
                adapt = i
                break
        out["steps_to_adapt"] = adapt
        out["steps_after_hog"] = len(after)
        errs = [s.error for s in after[adapt or 0 :]]
        out["error_median_after_adapt"] = statistics.median(errs) if errs else float("nan")
        out["error_p90_after_adapt"] = pct(errs, 90)
    return out


def client_stats(run: dict) -> dict:
    long = run["long"]
    start, end = long["sent"], long["tokens"][0] if long["tokens"] else float("inf")
    ttfts, gaps, tpots = [], [], []
    for c in run["chats"]:
        toks = c["tokens"]
        if not toks:
            continue
        ttfts.append(toks[0] - c["sent"])
        inside = [b - a for a, b in itertools.pairwise(toks) if a >= start and b <= end]
        gaps.extend(inside)
        if toks[0] >= start and toks[-1] <= end and len(toks) > 1:
            tpots.append((toks[-1] - toks[0]) / (len(toks) - 1))
    return {
        "long_ttft_s": end - start,
        "chats": len(run["chats"]),
        "chat_ttft_p50_s": pct(ttfts, 50),
        "chat_ttft_p90_s": pct(ttfts, 90),
        "itl_during_long_p90_s": pct(gaps, 90),
        "tpot_during_long_p90_s": pct(tpots, 90),
        "chats_decoding_during_long": len(tpots),
    }


def admission_stats(recs: list[dict]) -> dict:
    acc = [r for r in recs if r["status"] == 200 and r["tokens"]]
    rej = [r for r in recs if r["status"] == 429]
    met = [r for r in acc if (r["tokens"][0] - r["sent"]) * 1e3 <= r["slo_ms"]]
    lat = [r["answered"] - r["sent"] for r in rej]
    wire = [r["status_at"] - r["written"] for r in rej if "written" in r and "status_at" in r]
    return {
        "requests": len(recs),
        "accepted": len(acc),
        "rejected": len(rej),
        "other": len(recs) - len(acc) - len(rej),
        "accepted_meeting_slo": len(met) / len(acc) if acc else float("nan"),
        "all_meeting_slo": len(met) / len(recs) if recs else float("nan"),
        "reject_latency_p50_ms": pct(lat, 50) * 1e3,
        "reject_latency_p99_ms": pct(lat, 99) * 1e3,
        "reject_wire_p50_ms": pct(wire, 50) * 1e3,
        "reject_wire_p99_ms": pct(wire, 99) * 1e3,
        "reject_wire_within_10ms": (
            sum(1 for x in wire if x <= 0.010) / len(wire) if wire else float("nan")
        ),
    }


def server_reject_stats(url: str) -> dict:
    """``medha:admission_reject_seconds`` from the server's /metrics: the count, the share
    within 10 ms (a bucket bound, exact), p50 and p99 interpolated inside their buckets
    (as Prometheus' ``histogram_quantile``); empty for a server without it."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "medha:admission_reject_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    if not buckets or buckets[-1][1] == 0:
        return {}
    buckets.sort()
    # the same bucket interpolation as the prediction-error histogram's (seconds here)
    hist = ErrorHistogram(tuple(le for le, _ in buckets), tuple(c for _, c in buckets), 0.0, None)
    within = next(count for le, count in buckets if le >= 0.010)
    return {
        "server_reject_count": hist.count,
        "server_reject_p50_ms": hist.quantile(0.5) * 1e3,
        "server_reject_p99_ms": hist.quantile(0.99) * 1e3,
        "server_reject_within_10ms": within / hist.count,
    }


def capacity_tokens_per_s(steps: list[StepRecord]) -> float:
    """Prefill tokens per second of wall time over the quiet run's steps."""
    toks = sum(q for s in steps for q, _ in s.items if q > 1)
    span = steps[-1].monotonic_s + steps[-1].execute_s - steps[0].monotonic_s
    return toks / span


# --------------------------------------------------------------------- runs
def run_long(args: argparse.Namespace, name: str, hog_after: float | None) -> dict:
    out = Path(args.out)
    steps_path = out / f"{name}.steps.jsonl"
    flags = ["--max-model-len", str(args.long_tokens + 256), "--step-log", str(steps_path)]
    flags += ["--cost-model-out", str(out / f"{name}.online.json"), "--log-level", "warning"]
    server = start_tiny(flags, out / f"{name}.server.log", args.engine_threads, args.layout)
    try:
        run = asyncio.run(long_and_chats(args, server.url, hog_after))
    finally:
        stop_server(server)
    steps = read_step_log(steps_path)
    res = {**step_stats(steps, run["hog_at"]), **client_stats(run)}
    res["capacity_tokens_per_s"] = capacity_tokens_per_s(steps)
    print(f"  {name}: {json.dumps(res)}", flush=True)
    return res


def probe_capacity(args: argparse.Namespace, url: str) -> float:
    """Prefill tokens per second for the trace's mean prompt: a few requests, one at a time."""
    lo, hi = args.adm_prompt
    n = (lo + hi) // 2

    async def go() -> list[float]:
        rng = random.Random(args.seed + 3)
        async with httpx.AsyncClient(timeout=3600) as client:
            ttfts = []
            for _ in range(4):
                r = await stream_request(client, url, prompt_of(rng, n), 1, None)
                ttfts.append(r["tokens"][0] - r["sent"])
            return ttfts

    ttfts = asyncio.run(go())[1:]  # the first one warms up
    return n / statistics.median(ttfts)


def run_admission(args: argparse.Namespace, capacity: float | None) -> dict:
    out = Path(args.out)
    lo, hi = args.adm_prompt
    res: dict = {}
    servers = {}
    for mode in ("reject", "accept"):
        flags = ["--admission", mode, "--max-model-len", str(hi + 64), "--log-level", "warning"]
        flags += ["--step-log", str(out / f"admission-{mode}.steps.jsonl")]
        servers[mode] = (flags, out / f"admission-{mode}.server.log")
    trace: list[dict] = []
    for mode in ("reject", "accept"):
        flags, log = servers[mode]
        server = start_tiny(flags, log, args.engine_threads, args.layout)
        url = server.url
        try:
            if not trace:
                if capacity is None:
                    capacity = probe_capacity(args, url)
                rng = random.Random(args.seed + 2)
                rate = args.overload * capacity / ((lo + hi) / 2)
                t = 0.0
                while True:
                    t += rng.expovariate(rate)
                    if t >= args.adm_duration:
                        break
                    n = rng.randint(lo, hi)
                    slo = max(args.adm_min_slo, args.adm_slo_factor * n / capacity)
                    trace.append({"at": t, "prompt": n, "slo_ms": round(slo * 1e3, 1)})
                res.update(capacity_tokens_per_s=capacity, rate_per_s=rate, requests=len(trace))
                print(
                    f"  capacity {capacity:.0f} tokens/s; trace: {len(trace)} requests at "
                    f"{rate:.2f}/s ({args.overload}x capacity)"
                )
            time.sleep(1.0)  # a heartbeat with the queue snapshot
            recs = asyncio.run(replay(args, url, trace))
            server_side = server_reject_stats(url)
        finally:
            stop_server(server)
        res[mode] = {**admission_stats(recs), **server_side}
        (out / f"admission-{mode}.requests.json").write_text(json.dumps(recs))
        print(f"  admission {mode}: {json.dumps(res[mode])}", flush=True)
    return res


def fmt(x: object, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x * scale:.{digits}g}{unit}"
    return f"{x}{unit}"


def report(args: argparse.Namespace, results: dict) -> str:
    serve = " ".join(["serve tiny", *shlex.split(args.layout)])
    lines = [
        f"budget benchmark: {serve}, long prompt {args.long_tokens} tokens, a "
        f"{args.chat_prompt}-token chat ({args.chat_output} tokens out) every {args.chat_every} s",
        "",
        "| run | steps | T (ms) | error median | error p90 | steps > 1.25T | chat ITL p90 during "
        "long (ms) | chat TPOT p90 during long (ms) | chat TTFT p90 (s) | long TTFT (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("quiet", "hog"):
        r = results.get(name)
        if r is None:
            continue
        lines.append(
            f"| {name} | {r['steps']} | {fmt(r['target_s'], '', 1e3)} | "
            f"{fmt(r['error_median'], '%', 100)} | {fmt(r['error_p90'], '%', 100)} | "
            f"{r['steps_over_1.25T']} ({fmt(r['share_over_1.25T'], '%', 100)}) | "
            f"{fmt(r['itl_during_long_p90_s'], '', 1e3)} | "
            f"{fmt(r['tpot_during_long_p90_s'], '', 1e3)} | {fmt(r['chat_ttft_p90_s'])} | "
            f"{fmt(r['long_ttft_s'])} |"
        )
    hog = results.get("hog")
    if hog is not None:
        lines += [
            "",
            f"hog: median error {fmt(hog.get('error_median_before_hog'), '%', 100)} in the 50 "
            f"steps before it; {fmt(hog.get('steps_to_adapt'))} steps to the first 10-step "
            f"window under 10% (of {hog.get('steps_after_hog')} steps after it); afterwards "
            f"median {fmt(hog.get('error_median_after_adapt'), '%', 100)}, p90 "
            f"{fmt(hog.get('error_p90_after_adapt'), '%', 100)}",
        ]
    adm = results.get("admission")
    if adm is not None:
        lines += [
            "",
            f"admission: {adm['requests']} requests at {fmt(adm['rate_per_s'])}/s "
            f"({args.overload}x the server's prefill capacity, "
            f"{fmt(adm['capacity_tokens_per_s'])} tokens/s, probed one request at a time)",
            "",
            "| mode | accepted | rejected (429) | accepted meeting SLO | all meeting SLO | "
            "429 p50 / p99 (ms), client: from the call | client: request written to status "
            "read | server: arrival to 429 sent (buckets) | within 10 ms (client wire / "
            "server) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for mode in ("reject", "accept"):
            a = adm[mode]
            lines.append(
                f"| {mode} | {a['accepted']} | {a['rejected']} | "
                f"{fmt(a['accepted_meeting_slo'], '%', 100)} | "
                f"{fmt(a['all_meeting_slo'], '%', 100)} | "
                f"{fmt(a['reject_latency_p50_ms'])} / {fmt(a['reject_latency_p99_ms'])} | "
                f"{fmt(a['reject_wire_p50_ms'])} / {fmt(a['reject_wire_p99_ms'])} | "
                f"{fmt(a.get('server_reject_p50_ms'))} / {fmt(a.get('server_reject_p99_ms'))} | "
                f"{fmt(a['reject_wire_within_10ms'], '%', 100)} / "
                f"{fmt(a.get('server_reject_within_10ms'), '%', 100)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", required=True, help="directory for logs and results")
    ap.add_argument("--runs", default="quiet,hog,admission", help="comma-separated subset")
    ap.add_argument("--long-tokens", type=int, default=40960)
    ap.add_argument("--chat-every", type=float, default=0.5)
    ap.add_argument("--chat-prompt", type=int, default=128)
    ap.add_argument("--chat-output", type=int, default=32)
    ap.add_argument("--hog-procs", type=int, default=2, help="CPU-spinning processes")
    ap.add_argument("--hog-after", type=float, default=None, help="s (default: half quiet's)")
    ap.add_argument("--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of servers")
    ap.add_argument(
        "--layout",
        default="",
        help='serve flags of a parallel layout, e.g. "--spp 2" or "--tp 2 --kvp 2" (one host)',
    )
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--adm-duration", type=float, default=30.0)
    ap.add_argument("--adm-prompt", type=int, nargs=2, default=(256, 2048))
    ap.add_argument("--adm-slo-factor", type=float, default=3.0, help="SLO = factor x alone")
    ap.add_argument("--adm-min-slo", type=float, default=1.0, help="seconds")
    ap.add_argument(
        "--capacity", type=float, default=None, help="prefill tokens/s (default: probed)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = set(args.runs.split(","))
    results: dict = {}
    if "quiet" in runs:
        results["quiet"] = run_long(args, "quiet", None)
    if "hog" in runs:
        after = args.hog_after
        if after is None:
            after = results["quiet"]["long_ttft_s"] / 2 if "quiet" in results else 30.0
        results["hog"] = run_long(args, "hog", after)
    if "admission" in runs:
        results["admission"] = run_admission(args, args.capacity)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(args, results)
    (out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
