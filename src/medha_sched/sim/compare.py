"""Sweeps: policy variants x loads, each a full run, summarised in one table.

A *variant* is a policy with an optional chunking, written ``POLICY`` (adaptive
chunking) or ``POLICY@N`` (fixed chunks of N tokens; ``@0`` is no chunking),
e.g. ``fcfs@0,fcfs@512,fcfs@2048,edf,lrs,lars,lars-mp``. Every variant at one
load sees the same trace (same seed). Outputs under the sweep directory:
``traces/qps<X>.jsonl``, ``runs/<variant>_qps<X>/`` (each a normal run
directory), ``compare.csv``, ``compare.md`` and ``compare.png``.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from medha_sched.sim.runner import OptionError, RunSpec, run_to_dir
from medha_sched.sim.trace import read_trace, write_trace
from medha_sched.sim.workload import WorkloadSpec, generate

#: columns of compare.csv / compare.md, in order
COLUMNS = (
    "policy",
    "qps",
    "requests",
    "finished",
    "rejected",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "ttft_p50_short_s",
    "ttft_p90_short_s",
    "ttft_p50_long_s",
    "ttft_p90_long_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "goodput",
    "tokens_per_s",
    "sim_wall_s",
)


def parse_variants(text: str) -> list[tuple[str, int | None]]:
    """``"fcfs@512,lars"`` -> ``[("fcfs", 512), ("lars", None)]``; OptionError if malformed."""
    out: list[tuple[str, int | None]] = []
    for item in text.split(","):
        item = item.strip()
        name, at, chunk = item.partition("@")
        if not name:
            raise OptionError(f"--policies: empty variant in {text!r}")
        size: int | None = None
        if at:
            try:
                size = int(chunk)
            except ValueError:
                size = -1
            if size < 0:
                raise OptionError(
                    f"--policies: variant {item!r} needs POLICY@N with an integer N >= 0"
                )
        out.append((name, size))
    if len({(n, c) for n, c in out}) < len(out):
        raise OptionError(f"--policies: a variant repeats in {text!r}")
    return out


def parse_floats(flag: str, text: str) -> list[float]:
    """A comma-separated list of numbers > 0; OptionError naming ``flag``."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise OptionError(f"{flag}: expected numbers separated by commas, got {text!r}") from None
    if not values or any(not (v > 0 and v < float("inf")) for v in values):
        raise OptionError(f"{flag}: every value must be a finite number > 0, got {text!r}")
    return values


def _run_one(task: tuple[str, RunSpec, str]) -> dict[str, Any]:
    trace_path, spec, out_dir = task
    return run_to_dir(read_trace(trace_path), spec, out_dir, trace_path=trace_path)


def sweep(
    variants: Sequence[tuple[str, int | None]],
    qps_list: Sequence[float],
    workload: WorkloadSpec,
    base: RunSpec,
    out_dir: Path,
    *,
    jobs: int = 1,
    on_run_done: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every variant at every load; write the table and figure; return the rows."""
    specs = [dataclasses.replace(base, policy=p, chunk_size=c) for p, c in variants]
    for spec in specs:
        spec.build()  # fail on a bad variant before running anything
    (out_dir / "traces").mkdir(parents=True, exist_ok=True)
    tasks, keys = [], []
    for qps in qps_list:
        trace_path = out_dir / "traces" / f"qps{qps:g}.jsonl"
        write_trace(trace_path, generate(dataclasses.replace(workload, qps=qps)))
        for spec in specs:
            run_dir = out_dir / "runs" / f"{spec.label}_qps{qps:g}"
            tasks.append((str(trace_path), spec, str(run_dir)))
            keys.append((spec.label, qps))
    summaries: list[dict[str, Any]] = []
    if jobs <= 1:
        for task in tasks:
            summaries.append(_run_one(task))
            if on_run_done:
                on_run_done()
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for summary in pool.map(_run_one, tasks):
                summaries.append(summary)
                if on_run_done:
                    on_run_done()
    rows = [row_of(label, qps, s) for (label, qps), s in zip(keys, summaries, strict=True)]
    write_table(rows, out_dir)
    from medha_sched.sim.plot import plot_sweep

    plot_sweep(rows, out_dir / "compare.png")
    return rows


def row_of(label: str, qps: float, summary: dict[str, Any]) -> dict[str, Any]:
    """One table row from a run's summary."""
    ttft, tpot, counts = summary["ttft_s"], summary["tpot_s"], summary["counts"]
    return {
        "policy": label,
        "qps": qps,
        "requests": counts["requests"],
        "finished": counts["finished"],
        "rejected": counts["rejected"],
        "ttft_p50_s": ttft["all"]["p50"],
        "ttft_p90_s": ttft["all"]["p90"],
        "ttft_p99_s": ttft["all"]["p99"],
        "ttft_p50_short_s": ttft["short"]["p50"],
        "ttft_p90_short_s": ttft["short"]["p90"],
        "ttft_p50_long_s": ttft["long"]["p50"],
        "ttft_p90_long_s": ttft["long"]["p90"],
        "tpot_p50_s": tpot["all"]["p50"],
        "tpot_p90_s": tpot["all"]["p90"],
        "goodput": summary["goodput"],
        "tokens_per_s": summary["throughput"]["tokens_per_s"],
        "sim_wall_s": summary["sim_wall_s"],
    }


def write_table(rows: Sequence[dict[str, Any]], out_dir: Path) -> None:
    """``compare.csv`` and ``compare.md``."""
    with (out_dir / "compare.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    (out_dir / "compare.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _fmt(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)
