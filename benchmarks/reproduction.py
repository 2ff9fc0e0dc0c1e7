"""Put a ``medha-sim compare`` sweep beside the paper's scheduling claims.

Reads ``SWEEP/compare.csv`` (written by ``medha-sim compare``) and prints, as
Markdown, one table per claim of the paper (sections 4 and 6):

1. TTFT of short requests, non-preemptive FCFS (``fcfs@0``) over LARS with
   space sharing (``lars-mp``): the paper reports 30x at P50 and 174x at P90.
2. EDF against FCFS as the load grows: the paper says EDF collapses toward
   FCFS at high load.
3. Multi-prefill batching, ``lars`` over ``lars-mp``: 1.6-1.8x lower median.
4. Decode latency (P90 TPOT) with static chunks against adaptive chunking:
   bounded by the iteration budget only with adaptive chunking.

    python benchmarks/reproduction.py SWEEP_DIR [--out FILE.md]
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path


def load(sweep: Path) -> dict[tuple[str, float], dict[str, float]]:
    rows = {}
    with (sweep / "compare.csv").open(encoding="utf-8") as f:
        for row in csv.DictReader(f):
            values = {k: _num(v) for k, v in row.items() if k != "policy"}
            rows[(row["policy"], values["qps"])] = values
    return rows


def _num(text: str) -> float:
    return float(text) if text not in ("", "None") else math.nan


def ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b <= 0:
        return "–"
    return f"{a / b:.1f}x"


def secs(x: float) -> str:
    if math.isnan(x):
        return "–"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.1f} s"


def table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def claims(rows: dict[tuple[str, float], dict[str, float]]) -> str:
    loads = sorted({q for _, q in rows})
    get = rows.get
    parts = []

    lines = []
    for q in loads:
        base, ours = get(("fcfs@0", q)), get(("lars-mp", q))
        if base and ours:
            lines.append(
                [
                    f"{q:g}",
                    secs(base["ttft_p50_short_s"]),
                    secs(ours["ttft_p50_short_s"]),
                    ratio(base["ttft_p50_short_s"], ours["ttft_p50_short_s"]),
                    secs(base["ttft_p90_short_s"]),
                    secs(ours["ttft_p90_short_s"]),
                    ratio(base["ttft_p90_short_s"], ours["ttft_p90_short_s"]),
                ]
            )
    head = ["QPS", "fcfs@0 P50", "lars-mp P50", "P50 ratio", "fcfs@0 P90", "lars-mp P90"]
    parts.append("### 1. Short-request TTFT, non-preemptive FCFS over lars-mp\n")
    parts.append(table([*head, "P90 ratio"], lines))

    lines = []
    for q in loads:
        f, e, lm = get(("fcfs", q)), get(("edf", q)), get(("lars-mp", q))
        if f and e and lm:
            lines.append(
                [
                    f"{q:g}",
                    secs(f["ttft_p90_s"]),
                    secs(e["ttft_p90_s"]),
                    secs(lm["ttft_p90_s"]),
                    secs(e["ttft_p90_long_s"]),
                    f"{e['goodput']:.3f} / {f['goodput']:.3f} / {lm['goodput']:.3f}",
                ]
            )
    parts.append("\n\n### 2. EDF against FCFS (both with adaptive chunks) as the load grows\n")
    head = ["QPS", "fcfs P90 TTFT", "edf P90 TTFT", "lars-mp P90 TTFT", "edf long P90"]
    parts.append(table([*head, "goodput edf / fcfs / lars-mp"], lines))

    lines = []
    for q in loads:
        a, b = get(("lars", q)), get(("lars-mp", q))
        if a and b:
            lines.append(
                [
                    f"{q:g}",
                    secs(a["ttft_p50_s"]),
                    secs(b["ttft_p50_s"]),
                    ratio(a["ttft_p50_s"], b["ttft_p50_s"]),
                    secs(a["ttft_p50_long_s"]),
                    secs(b["ttft_p50_long_s"]),
                    ratio(a["ttft_p50_long_s"], b["ttft_p50_long_s"]),
                ]
            )
    head = ["QPS", "lars P50", "lars-mp P50", "ratio", "lars long P50", "lars-mp long P50"]
    parts.append("\n\n### 3. Multi-prefill batching: lars over lars-mp (TTFT)\n")
    parts.append(table([*head, "ratio"], lines))

    variants = [v for v in ("fcfs@512", "fcfs@2048", "lars-mp@512", "lars-mp@2048", "lars-mp")]
    lines = []
    for q in loads:
        line = [f"{q:g}"]
        for v in variants:
            r = get((v, q))
            line.append(secs(r["tpot_p90_s"]) if r else "–")
        lines.append(line)
    parts.append("\n\n### 4. P90 TPOT: static chunks against adaptive chunking\n")
    parts.append(table(["QPS", *variants], lines))
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="a medha-sim compare output directory")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args()
    if not (args.sweep / "compare.csv").exists():
        raise SystemExit(f"{args.sweep}/compare.csv not found: run medha-sim compare first")
    text = claims(load(args.sweep))
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
