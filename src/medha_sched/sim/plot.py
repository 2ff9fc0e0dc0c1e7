"""Figures from run directories (PNG, matplotlib's Agg backend, imported lazily).

``plot_runs``: TTFT CDF, TPOT CDF and TTFT over arrival time, one colour per
run. ``plot_sweep``: the metrics of a ``compare`` sweep against load, one
line per policy variant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from medha_sched.sim.metrics import read_requests


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_figure_path(out: str | Path, *, flag: str = "--out") -> None:
    """Raise ValueError (naming ``flag``) when matplotlib cannot write ``out``'s format
    (no suffix: PNG)."""
    suffix = Path(out).suffix.lower().lstrip(".")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(
            f"{flag} {str(out)!r}: matplotlib cannot write .{suffix} figures; "
            f"use one of {', '.join(sorted(formats))}"
        )


def run_label(run_dir: Path) -> str:
    """The run's policy label from its ``summary.json``, else the directory name."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        return str(summary["run"]["label"])
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.name


def plot_runs(run_dirs: Sequence[Path], out: Path, *, labels: Sequence[str] | None = None) -> None:
    """TTFT and TPOT CDFs and TTFT over time for each run directory."""
    plt = _pyplot()
    if labels is None:
        labels = [run_label(d) for d in run_dirs]
        if len(set(labels)) < len(labels):  # same policy twice: tell them apart
            labels = [f"{lab} ({d.name})" for lab, d in zip(labels, run_dirs, strict=True)]
    fig, (ax_ttft, ax_tpot, ax_time) = plt.subplots(1, 3, figsize=(16, 4.6))
    for run_dir, label in zip(run_dirs, labels, strict=True):
        rows = read_requests(run_dir / "requests.jsonl")
        ttft = [r["ttft_s"] for r in rows if r.get("ttft_s") is not None]
        tpot = [r["tpot_s"] for r in rows if r.get("tpot_s") is not None]
        (line,) = _cdf(ax_ttft, ttft, label)
        _cdf(ax_tpot, tpot, label, color=line.get_color())
        pts = [(r["arrival_s"], r["ttft_s"]) for r in rows if r.get("ttft_s") is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax_time.scatter(xs, ys, s=4, alpha=0.5, color=line.get_color(), label=label)
    ax_ttft.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax_tpot.set(xscale="log", xlabel="TPOT (s)", ylabel="fraction of requests", title="TPOT CDF")
    ax_time.set(yscale="log", xlabel="arrival time (s)", ylabel="TTFT (s)", title="TTFT over time")
    for ax in (ax_ttft, ax_tpot, ax_time):
        ax.grid(True, which="both", alpha=0.3)
    ax_ttft.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _cdf(ax: Any, values: Sequence[float], label: str, **kwargs: Any) -> Any:
    xs = sorted(v for v in values if v > 0)
    ys = [(i + 1) / len(xs) for i in range(len(xs))] if xs else []
    return ax.step(xs, ys, where="post", label=label, **kwargs)


#: (row key, panel title) of the sweep figure
SWEEP_PANELS = (
    ("ttft_p50_short_s", "short requests: median TTFT (s)"),
    ("ttft_p90_short_s", "short requests: P90 TTFT (s)"),
    ("ttft_p50_long_s", "long requests: median TTFT (s)"),
    ("tpot_p90_s", "all requests: P90 TPOT (s)"),
)


def plot_sweep(rows: Sequence[Mapping[str, Any]], out: Path) -> None:
    """One panel per metric in :data:`SWEEP_PANELS`, x = QPS, one line per variant."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(SWEEP_PANELS), figsize=(4.2 * len(SWEEP_PANELS), 4))
    variants = list(dict.fromkeys(r["policy"] for r in rows))
    for ax, (key, title) in zip(axes, SWEEP_PANELS, strict=True):
        for v in variants:
            pts = sorted(
                (r["qps"], r[key]) for r in rows if r["policy"] == v and r[key] is not None
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=v)
        ax.set(yscale="log", xlabel="load (QPS)", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
