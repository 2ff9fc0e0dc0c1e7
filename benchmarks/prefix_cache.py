"""Prefix caching: multi-turn sessions over a shared document, and cache-aware slack.

Two parts, one command each (both by default)::

    python benchmarks/prefix_cache.py runtime   # the engine on `tiny` (CPU), caching on vs off
    python benchmarks/prefix_cache.py sim       # medha-sim: cache-aware vs length-based slack

**runtime**: ``--sessions`` chat sessions (default 8) over one shared
``--doc-tokens`` document (default 16,384 tokens, random ids), ``--turns``
turns each (default 4). Turn ``k`` of a session sends the session so far
(the document, every earlier question and answer) plus a new
``--question-tokens`` question (default 64) and generates ``--answer-tokens``
greedy tokens. Requests go one at a time, turn by turn round the sessions,
so a request's TTFT is its own prefill (no queueing). The same engine
settings run twice in this one process: caching on (all sessions) and caching
off (``--off-sessions`` sessions, default 2: every cold request costs the
same whole-document prefill, so fewer suffice). Reports TTFT by turn, the
turns 2+ ratio off/on, and the fraction of prompt tokens served from the
cache on turns 2+. The greedy answers of the sessions both runs have must
agree token for token.

**sim**: one trace mixing short ShareGPT4-like requests, multi-turn sessions
over long documents (turns 2+ are cached) and uncached long requests, run
through ``medha-sim``'s replica with prefix caching on twice: LARS with
cache-aware slack (prefill work = uncached tokens) and with length-based
slack (work = prompt length, what a cache-oblivious scheduler prices).
Reports short-request TTFT p50/p90 and the cache hit rate of both.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


# ------------------------------------------------------------------ runtime
def _session_prompts(doc: list[int], args: argparse.Namespace, rng: random.Random):
    """Per session, a closure giving turn k's prompt from the answers so far."""
    questions = [
        [[rng.randrange(3, 250) for _ in range(args.question_tokens)] for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]

    def prompt(session: int, turn: int, answers: list[list[int]]) -> list[int]:
        ids = list(doc)
        for k in range(turn):
            ids += questions[session][k] + answers[k]
        return ids + questions[session][turn]

    return prompt


def _run_engine(args: argparse.Namespace, caching: bool, sessions: int) -> dict:
    from medha_runtime import LLM, SamplingParams

    rng = random.Random(args.seed)
    doc = [rng.randrange(3, 250) for _ in range(args.doc_tokens)]
    prompt = _session_prompts(doc, args, rng)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    longest = args.doc_tokens + args.turns * (args.question_tokens + args.answer_tokens)
    max_len = -(-(longest + 64) // 1024) * 1024
    rows = []
    answers: list[list[list[int]]] = [[] for _ in range(sessions)]
    with LLM(
        "tiny",
        max_model_len=max_len,
        kv_cache_tokens=max(4 * max_len, 1 << 17),
        enable_prefix_caching=caching,
        seed=args.seed,
    ) as llm:
        engine = llm.engine
        for turn in range(args.turns):
            for s in range(sessions):
                ids = prompt(s, turn, answers[s])
                t0 = time.perf_counter()
                rid = engine.add_request(ids, params)
                ttft, out = None, None
                while out is None:
                    for o in engine.step():
                        if o.request_id == rid:
                            out = o
                    if ttft is None:
                        progress = engine.progress(rid)
                        if out is not None or (progress and progress.output_ids):
                            ttft = time.perf_counter() - t0
                answers[s].append(out.outputs[0].token_ids)
                rows.append(
                    {
                        "session": s,
                        "turn": turn + 1,
                        "prompt_tokens": len(ids),
                        "cached_tokens": out.num_cached_tokens,
                        "ttft_s": ttft,
                    }
                )
                print(
                    f"  caching {'on ' if caching else 'off'} session {s} turn {turn + 1}: "
                    f"{len(ids)} prompt tokens, {out.num_cached_tokens} cached, "
                    f"TTFT {ttft:.3f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return {"rows": rows, "answers": answers}


def runtime(args: argparse.Namespace) -> dict:
    on = _run_engine(args, True, args.sessions)
    off = _run_engine(args, False, args.off_sessions)
    for s in range(args.off_sessions):
        if on["answers"][s] != off["answers"][s]:
            raise SystemExit(f"session {s}: greedy answers differ with and without caching")

    def ttfts(rows, later: bool) -> list[float]:
        return [r["ttft_s"] for r in rows if (r["turn"] > 1) == later]

    on_later, off_later = ttfts(on["rows"], True), ttfts(off["rows"], True)
    later = [r for r in on["rows"] if r["turn"] > 1]
    hit_rate = sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)
    result = {
        "setup": {
            "model": "tiny",
            "doc_tokens": args.doc_tokens,
            "sessions_on": args.sessions,
            "sessions_off": args.off_sessions,
            "turns": args.turns,
            "question_tokens": args.question_tokens,
            "answer_tokens": args.answer_tokens,
        },
        "ttft_turn1_s": {
            "on_median": statistics.median(ttfts(on["rows"], False)),
            "off_median": statistics.median(ttfts(off["rows"], False)),
        },
        "ttft_later_s": {
            "on_median": statistics.median(on_later),
            "off_median": statistics.median(off_later),
            "on_max": max(on_later),
            "off_min": min(off_later),
        },
        "later_ttft_ratio_off_over_on": statistics.median(off_later) / statistics.median(on_later),
        "later_hit_rate": hit_rate,
        "answers_match": True,
        "rows": {"on": on["rows"], "off": off["rows"]},
    }
    return result


# ---------------------------------------------------------------------- sim
def sim(args: argparse.Namespace) -> dict:
    from medha_sched.sim.engine import simulate
    from medha_sched.sim.metrics import summarize
    from medha_sched.sim.runner import RunSpec
    from medha_sched.sim.trace import TraceRequest
    from medha_sched.sim.workload import SessionSpec, WorkloadSpec, generate, generate_sessions

    shorts = generate(
        WorkloadSpec(qps=args.short_qps, duration_s=args.duration, long_fraction=0.0, seed=1)
    )
    sessions = generate_sessions(
        SessionSpec(
            num_sessions=args.sim_sessions,
            turns=args.sim_turns,
            qps=args.sim_sessions / args.duration,
            doc_tokens=args.sim_doc_tokens,
            think_s=args.think,
            seed=2,
        )
    )
    longs = generate(
        WorkloadSpec(
            qps=args.uncached_long_qps,
            duration_s=args.duration,
            long_fraction=1.0,
            seed=3,
            max_context=args.sim_doc_tokens * 2,
            long_min_prompt=args.sim_doc_tokens // 2,
        )
    )
    longs = [TraceRequest(f"u{r.id}", r.arrival_s, r.prompt_tokens, r.output_tokens) for r in longs]
    trace = sorted(shorts + sessions + longs, key=lambda r: r.arrival_s)
    out: dict = {
        "trace": {
            "short": len(shorts),
            "session_turns": len(sessions),
            "uncached_long": len(longs),
            "duration_s": args.duration,
        }
    }
    for slack in ("cache-aware", "length"):
        spec = RunSpec(
            policy=args.policy,
            kv_cache_tokens=args.sim_kv_tokens,
            slack=slack,
            long_threshold=32768,
        )
        config, model, cache = spec.build()
        t0 = time.perf_counter()
        result = simulate(trace, config, model, cache=cache)
        summary = summarize(result.records, result.iterations, long_threshold=32768, num_stages=1)
        ttft = summary["ttft_s"]
        out[slack] = {
            "short_ttft_p50_s": ttft["short"]["p50"],
            "short_ttft_p90_s": ttft["short"]["p90"],
            "long_ttft_p90_s": ttft["long"]["p90"],
            "hit_rate": result.prefix_cache_hits / max(1, result.prefix_cache_queries),
            "preemptions": summary["counts"]["preemptions"],
            "wall_s": time.perf_counter() - t0,
        }
        print(f"  {slack}: {out[slack]}", file=sys.stderr, flush=True)
    out["short_p90_ratio_length_over_aware"] = (
        out["length"]["short_ttft_p90_s"] / out["cache-aware"]["short_ttft_p90_s"]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="*", choices=["runtime", "sim"], default=[])
    p.add_argument("--doc-tokens", type=int, default=16384)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--off-sessions", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="lars")
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--short-qps", type=float, default=1.0)
    p.add_argument("--uncached-long-qps", type=float, default=0.01)
    p.add_argument("--sim-sessions", type=int, default=6)
    p.add_argument("--sim-turns", type=int, default=4)
    p.add_argument("--sim-doc-tokens", type=int, default=131072)
    p.add_argument("--sim-kv-tokens", type=int, default=1 << 20)
    p.add_argument("--think", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.off_sessions > args.sessions:
        p.error("--off-sessions must be <= --sessions")
    parts = args.parts or ["runtime", "sim"]
    results = {}
    if "sim" in parts:
        results["sim"] = sim(args)
    if "runtime" in parts:
        results["runtime"] = runtime(args)
    text = json.dumps(results, indent=2)
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in results.items()}
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
