"""``medha-sim``: simulate a Medha replica from the command line.

    medha-sim gen --qps 1.0 --duration 600 --long-fraction 0.05 --seed 0 --out trace.jsonl
    medha-sim run --trace trace.jsonl --policy lars-mp \\
        --cost-model roofline:model=llama3-8b,gpu=a100 --tp 8 --spp 2 \\
        --target-batch-time 0.05 --out runs/lars-mp
    medha-sim sessions --sessions 8 --turns 4 --qps 0.05 --doc-tokens 16384 --out chat.jsonl
    medha-sim plot runs/fcfs runs/lars-mp --out ttft.png
    medha-sim compare --qps 0.25,0.75 --duration 300 --out sweep

Bad flags, specs or trace lines print one line naming them and exit with
status 2; a simulation that cannot go on exits with status 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from medha_sched.extras import MissingExtra, require
from medha_sched.policies import available_policies

EXIT_USAGE = 2
EXIT_FAILED = 1


class UsageError(Exception):
    """A bad flag or input; the message names it."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_float(text: str) -> float:
    value = _number(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


# ------------------------------------------------------------------ parsers
def _add_replica_options(p: argparse.ArgumentParser) -> None:
    from medha_sched.sim.defaults import (
        DEFAULT_COST_MODEL,
        DEFAULT_KV_CACHE_TOKENS,
        DEFAULT_TARGET_BATCH_TIME,
    )

    g = p.add_argument_group("replica")
    g.add_argument(
        "--cost-model",
        default=DEFAULT_COST_MODEL,
        metavar="SPEC",
        help="affine:base=S,per_token=S,per_attn=S | roofline:model=M,gpu=G | table:PATH | "
        "online:STATE.json (what a server learned: serve --cost-model-out) "
        f"(default {DEFAULT_COST_MODEL}; parallelism comes from --tp/--spp/--kvp)",
    )
    g.add_argument(
        "--target-batch-time",
        type=_positive_float,
        default=DEFAULT_TARGET_BATCH_TIME,
        metavar="SECONDS",
        help=f"iteration budget T (default {DEFAULT_TARGET_BATCH_TIME})",
    )
    for flag, what in (("--tp", "tensor"), ("--spp", "stream-pipeline"), ("--kvp", "KV-cache")):
        g.add_argument(flag, type=_int_at_least(1), default=1, metavar="N", help=f"{what} degree")
    g.add_argument(
        "--kv-cache-tokens",
        type=_int_at_least(1),
        default=DEFAULT_KV_CACHE_TOKENS,
        metavar="N",
        help=f"KV capacity of each KVP group in tokens (default {DEFAULT_KV_CACHE_TOKENS:,}, "
        "about Llama-3-8B on 16 A100-80GB)",
    )
    g.add_argument(
        "--max-tokens-per-group",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="most tokens of one request per KVP group (Gmax; default: a whole group)",
    )
    g.add_argument(
        "--long-threshold",
        type=_int_at_least(1),
        default=32768,
        metavar="N",
        help="prompts this long are long: one per KVP group per batch, and 'long' in the "
        "summary (default 32768)",
    )
    g.add_argument(
        "--admission-delay",
        type=_non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="time from a request's arrival until the scheduler sees it (a real server's "
        "HTTP, tokenisation and IPC); latencies still count from the arrival (default 0)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prefixes shared through the trace's prefix_id (default: on)",
    )
    g.add_argument(
        "--slack",
        choices=("cache-aware", "length"),
        default="cache-aware",
        help="price a prefill (deadline, LARS slack, SRPT) by its uncached tokens or by its "
        "prompt length (default cache-aware)",
    )


def _add_workload_options(p: argparse.ArgumentParser, *, qps: bool) -> None:
    g = p.add_argument_group("workload")
    if qps:
        g.add_argument("--qps", type=_positive_float, required=True, help="mean arrival rate")
    span = g.add_mutually_exclusive_group(required=True)
    span.add_argument("--duration", type=_positive_float, metavar="S", help="arrivals in [0, S)")
    span.add_argument(
        "--num-requests", type=_int_at_least(1), metavar="N", help="exactly N requests"
    )
    g.add_argument(
        "--long-fraction",
        type=_fraction,
        default=0.05,
        metavar="F",
        help="fraction of long (Medha-SWE) requests (default 0.05)",
    )
    g.add_argument("--seed", type=_int_at_least(0), default=0, help="random seed (default 0)")
    g.add_argument(
        "--arrival",
        choices=("poisson", "gamma"),
        default="poisson",
        help="arrival process (default poisson)",
    )
    g.add_argument(
        "--cv",
        type=_positive_float,
        default=2.0,
        help="coefficient of variation of gamma gaps (default 2.0; ignored for poisson)",
    )
    g.add_argument(
        "--max-context",
        type=_int_at_least(2),
        default=1 << 20,
        metavar="N",
        help="longest long request, prompt + output tokens (default 1048576)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="medha-sim",
        description="Discrete-event simulator of one Medha replica driving the real scheduler.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="simulate a trace", description="Simulate a JSONL trace.")
    run.add_argument("--trace", required=True, type=Path, metavar="FILE", help="JSONL trace")
    run.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    run.add_argument(
        "--policy",
        choices=available_policies(),
        default="lars-mp",
        help="scheduling policy (default lars-mp)",
    )
    run.add_argument(
        "--chunk-size",
        type=_int_at_least(0),
        default=None,
        metavar="N",
        help="fixed chunk of N tokens (Sarathi-style); 0 = no chunking; omit for adaptive chunking",
    )
    _add_replica_options(run)
    run.add_argument(
        "--iterations",
        action="store_true",
        help="also write iterations.csv, one row per batch (large for long runs)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar or summary table")

    gen = sub.add_parser(
        "gen", help="generate a trace", description="Generate a mixed short/long trace."
    )
    _add_workload_options(gen, qps=True)
    gen.add_argument("--out", required=True, type=Path, metavar="FILE", help="JSONL file")

    ses = sub.add_parser(
        "sessions",
        help="generate multi-turn sessions",
        description="Generate multi-turn sessions over long documents: every turn resends "
        "the session so far (prefix_id = the session) plus a new question.",
    )
    ses.add_argument("--sessions", type=_int_at_least(1), required=True, metavar="N")
    ses.add_argument("--turns", type=_int_at_least(1), required=True, metavar="K")
    ses.add_argument("--qps", type=_positive_float, required=True, help="sessions opened per s")
    ses.add_argument(
        "--doc-tokens",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="document length (default: Medha-SWE prompt lengths)",
    )
    ses.add_argument(
        "--question-tokens", type=_int_at_least(1), default=64, metavar="N", help="(default 64)"
    )
    ses.add_argument(
        "--output-tokens",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="answer length (default: ShareGPT4 output lengths)",
    )
    ses.add_argument(
        "--think",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="mean seconds between turns (default 30)",
    )
    ses.add_argument("--max-context", type=_int_at_least(2), default=1 << 20, metavar="N")
    ses.add_argument("--seed", type=_int_at_least(0), default=0)
    ses.add_argument("--out", required=True, type=Path, metavar="FILE", help="JSONL file")

    plot = sub.add_parser(
        "plot", help="plot runs", description="TTFT/TPOT CDFs and TTFT over time."
    )
    plot.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run directories")
    plot.add_argument("--out", required=True, type=Path, metavar="FILE.png")
    plot.add_argument("--labels", default=None, help="comma-separated legend labels")

    cmp = sub.add_parser(
        "compare",
        help="sweep policies x loads",
        description="Run every policy variant at every load; write a table and a figure.",
    )
    from medha_sched.sim.defaults import DEFAULT_QPS, DEFAULT_VARIANTS

    cmp.add_argument(
        "--policies",
        default=DEFAULT_VARIANTS,
        metavar="LIST",
        help=f"variants POLICY or POLICY@CHUNK, comma-separated (default {DEFAULT_VARIANTS})",
    )
    cmp.add_argument(
        "--qps",
        default=DEFAULT_QPS,
        metavar="LIST",
        help=f"loads, comma-separated (default {DEFAULT_QPS})",
    )
    _add_workload_options(cmp, qps=False)
    _add_replica_options(cmp)
    cmp.add_argument("--jobs", type=_int_at_least(1), default=1, help="parallel runs (default 1)")
    cmp.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    cmp.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


# ----------------------------------------------------------------- commands
def _replica_spec(args: argparse.Namespace, **extra: Any) -> Any:
    from medha_sched.sim.runner import RunSpec

    spec = RunSpec(
        cost_model=args.cost_model,
        target_batch_time=args.target_batch_time,
        tp=args.tp,
        spp=args.spp,
        kvp=args.kvp,
        kv_cache_tokens=args.kv_cache_tokens,
        max_tokens_per_group=args.max_tokens_per_group,
        long_threshold=args.long_threshold,
        admission_delay_s=args.admission_delay,
        prefix_caching=args.enable_prefix_caching,
        slack=args.slack,
        **extra,
    )
    spec.build()  # validate every option before any work
    return spec


def _workload(args: argparse.Namespace, qps: float) -> Any:
    from medha_sched.sim.workload import WorkloadSpec

    try:
        return WorkloadSpec(
            qps=qps,
            duration_s=args.duration,
            num_requests=args.num_requests,
            long_fraction=args.long_fraction,
            seed=args.seed,
            arrival=args.arrival,
            cv=args.cv,
            max_context=args.max_context,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _progress_bar(total: int, quiet: bool, unit: str) -> Any:
    from tqdm import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(total=total, unit=unit, file=sys.stderr, disable=disable, dynamic_ncols=True)


def cmd_run(args: argparse.Namespace) -> int:
    from medha_sched.sim.runner import run_to_dir
    from medha_sched.sim.trace import read_trace

    spec = _replica_spec(args, policy=args.policy, chunk_size=args.chunk_size)
    if not args.trace.is_file():
        raise UsageError(f"--trace {str(args.trace)!r}: no such file")
    trace = read_trace(args.trace)
    with _progress_bar(len(trace), args.quiet, "req") as bar:
        summary = run_to_dir(
            trace,
            spec,
            args.out,
            progress=bar.update,
            trace_path=str(args.trace),
            iterations=args.iterations,
        )
    if not args.quiet:
        print(format_summary(summary))
    print(f"wrote {args.out / 'requests.jsonl'} and {args.out / 'summary.json'}")
    return 0


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    c = summary["counts"]
    lines = [
        f"{summary['run']['label']}: {c['requests']} requests, {c['finished']} finished, "
        f"{c['rejected']} rejected, {c['preemptions']} preemptions, {c['iterations']} batches; "
        f"simulated {summary['simulated_s']:.1f} s in {summary['sim_wall_s']:.1f} s",
        f"{'':6} {'n':>6} {'TTFT p50':>9} {'p90':>9} {'p99':>9} {'TPOT p50':>9} {'p90':>9}",
    ]
    for group in ("all", "short", "long"):
        t, p = summary["ttft_s"][group], summary["tpot_s"][group]
        cells = [t["p50"], t["p90"], t["p99"], p["p50"], p["p90"]]
        lines.append(f"{group:6} {t['n']:>6} " + " ".join(_cell(v) for v in cells))
    goodput = summary["goodput"]
    lines.append(
        f"goodput (deadline met): {'–' if goodput is None else f'{goodput:.3f}'}, "
        f"throughput: {_cell(summary['throughput']['tokens_per_s'])} tokens/s"
    )
    return "\n".join(lines)


def _cell(v: float | None) -> str:
    return f"{'–':>9}" if v is None else f"{v:>9.3g}"


def cmd_gen(args: argparse.Namespace) -> int:
    from medha_sched.sim.trace import write_trace
    from medha_sched.sim.workload import generate

    spec = _workload(args, args.qps)
    trace = generate(spec)
    n = write_trace(args.out, trace)
    n_long = sum(r.prompt_tokens >= 32768 for r in trace)
    span = trace[-1].arrival_s if trace else 0.0
    print(f"wrote {n} requests ({n_long} long) arriving over {span:.1f} s to {args.out}")
    return 0


def cmd_sessions(args: argparse.Namespace) -> int:
    from medha_sched.sim.trace import write_trace
    from medha_sched.sim.workload import SessionSpec, generate_sessions

    try:
        spec = SessionSpec(
            num_sessions=args.sessions,
            turns=args.turns,
            qps=args.qps,
            doc_tokens=args.doc_tokens,
            question_tokens=args.question_tokens,
            output_tokens=args.output_tokens,
            think_s=args.think,
            max_context=args.max_context,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    trace = generate_sessions(spec)
    n = write_trace(args.out, trace)
    span = trace[-1].arrival_s if trace else 0.0
    print(f"wrote {n} turns of {args.sessions} sessions arriving over {span:.1f} s to {args.out}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from medha_sched.sim.plot import check_figure_path, plot_runs

    try:
        check_figure_path(args.out)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for d in args.dirs:
        if not (d / "requests.jsonl").is_file():
            raise UsageError(
                f"DIR {str(d)!r} has no requests.jsonl (not a medha-sim run directory)"
            )
    labels = None
    if args.labels is not None:
        labels = [x.strip() for x in args.labels.split(",")]
        if len(labels) != len(args.dirs):
            raise UsageError(f"--labels gives {len(labels)} labels for {len(args.dirs)} DIRs")
    plot_runs(args.dirs, args.out, labels=labels)
    print(f"wrote {args.out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from medha_sched.sim.compare import parse_floats, parse_variants, sweep

    variants = parse_variants(args.policies)
    qps_list = parse_floats("--qps", args.qps)
    names = [f"{q:g}" for q in qps_list]  # as the run directories name them
    if len(set(names)) < len(names):
        raise UsageError(f"--qps: a load repeats in {args.qps!r} (as {', '.join(names)})")
    base = _replica_spec(args)
    workload = _workload(args, qps_list[0])
    for policy, chunk in variants:  # name the bad variant before any run starts
        _check_variant(base, policy, chunk)
    args.out.mkdir(parents=True, exist_ok=True)
    total = len(variants) * len(qps_list)
    with _progress_bar(total, args.quiet, "run") as bar:
        rows = sweep(
            variants,
            qps_list,
            workload,
            base,
            args.out,
            jobs=args.jobs,
            on_run_done=lambda: bar.update(1),
        )
    print((args.out / "compare.md").read_text(encoding="utf-8"), end="")
    print(f"wrote {len(rows)} runs to {args.out} (compare.md, compare.csv, compare.png)")
    return 0


def _check_variant(base: Any, policy: str, chunk: int | None) -> None:
    import dataclasses

    from medha_sched.sim.runner import OptionError

    try:
        dataclasses.replace(base, policy=policy, chunk_size=chunk).build()
    except OptionError as exc:
        raise UsageError(
            f"--policies: variant {policy}{'' if chunk is None else f'@{chunk}'}: {exc}"
        ) from None


COMMANDS = {
    "run": cmd_run,
    "gen": cmd_gen,
    "sessions": cmd_sessions,
    "plot": cmd_plot,
    "compare": cmd_compare,
}
#: the third-party modules each command needs, all from the ``sim`` extra
NEEDS = {
    "run": ("numpy", "tqdm"),
    "gen": ("numpy",),
    "sessions": ("numpy",),
    "plot": ("numpy", "matplotlib"),
    "compare": ("numpy", "matplotlib", "tqdm"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 failed simulation, 2 bad usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"medha-sim {args.command}"
    try:
        require(NEEDS[args.command], extra="sim")
    except MissingExtra as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from medha_sched.sim.engine import SimulationError
    from medha_sched.sim.runner import OptionError
    from medha_sched.sim.trace import TraceError
    from medha_sched.sim.workload import WorkloadTooLarge

    try:
        return COMMANDS[args.command](args)
    except (UsageError, OptionError, TraceError, WorkloadTooLarge) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SimulationError as exc:
        print(f"{prog}: simulation failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"{prog}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
