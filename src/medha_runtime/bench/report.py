"""The summary as a readable table: one column per group (all, short, long)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_COUNTS = (
    ("requests", "Requests", "{:d}"),
    ("completed", "Completed", "{:d}"),
    ("failed", "Failed", "{:d}"),
    ("prompt_tokens", "Prompt tokens", "{:d}"),
    ("output_tokens", "Output tokens", "{:d}"),
    ("request_throughput", "Requests/s", "{:.2f}"),
    ("output_throughput", "Output tokens/s", "{:.1f}"),
    ("total_token_throughput", "Total tokens/s", "{:.1f}"),
)
_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def format_summary(summary: Mapping[str, Mapping[str, Any]], percentiles: Sequence[float]) -> str:
    """A fixed-width table of ``summary`` (as made by :func:`metrics.summarize`)."""
    groups = list(summary)
    rows: list[tuple[str, list[str]]] = []
    first = summary[groups[0]]
    rows.append(("Duration (s)", [f"{first['duration_s']:.2f}"] + [""] * (len(groups) - 1)))
    for key, label, fmt in _COUNTS:
        rows.append((label, [fmt.format(summary[g][key]) for g in groups]))
    for key, name in _LATENCIES:
        median = [] if 50 in percentiles else ["median"]
        stats = ["mean", *median, *(f"p{q:g}" for q in percentiles)]
        for stat in stats:
            rows.append((f"{name} {stat} (ms)", [_ms(summary[g][key].get(stat)) for g in groups]))
    rows += _goodput_rows(summary, groups)
    width = max(len(label) for label, _ in rows) + 2
    header = "".ljust(width) + "".join(g.rjust(12) for g in groups)
    lines = [" Benchmark result ".center(len(header), "="), header]
    lines += [label.ljust(width) + "".join(v.rjust(12) for v in vals) for label, vals in rows]
    lines += _failure_lines(summary.get("all", first))
    lines.append("=" * len(header))
    return "\n".join(lines)


def _goodput_rows(
    summary: Mapping[str, Mapping[str, Any]], groups: list[str]
) -> list[tuple[str, list[str]]]:
    rows = []
    if all(summary[g].get("goodput") for g in groups):
        good = [summary[g]["goodput"] for g in groups]
        rows.append(("Goodput (req/s)", [f"{x['request_goodput']:.2f}" for x in good]))
        rows.append(("Good fraction", [_pct(x["fraction"]) for x in good]))
    if all(summary[g].get("slo_attainment") for g in groups):
        met = [summary[g]["slo_attainment"]["fraction"] for g in groups]
        rows.append(("Own SLOs met", [_pct(x) for x in met]))
    return rows


def _failure_lines(group: Mapping[str, Any]) -> list[str]:
    reasons = group.get("failure_reasons") or {}
    return [f"failed x{count}: {reason}" for reason, count in reasons.items()]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
