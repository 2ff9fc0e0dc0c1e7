"""CDFs of TTFT, TPOT and ITL (PNG; matplotlib's Agg backend, imported only here, lazily)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from medha_runtime.bench.record import RequestRecord

_PANELS = (
    ("TTFT (ms)", lambda r: [r.ttft_s]),
    ("TPOT (ms)", lambda r: [r.tpot_s]),
    ("ITL (ms)", lambda r: r.itl_s),
)


def plot_cdfs(records: Sequence[RequestRecord], out: str | Path, *, title: str = "") -> None:
    """One panel per metric, one line per group (all, short, long) of completed requests."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(15, 4.2))
    done = [r for r in records if r.ok]
    groups = {"all": done, "short": [r for r in done if r.kind == "short"]}
    groups["long"] = [r for r in done if r.kind == "long"]
    for ax, (label, pick) in zip(axes, _PANELS, strict=True):
        for name, members in groups.items():
            if name != "all" and len(members) in (0, len(done)):
                continue  # an empty group, or the same line as "all"
            values = [1e3 * v for r in members for v in pick(r) if v is not None]
            _cdf(ax, values, f"{name} (n={len(values)})")
            if name == "all" and values and min(values) > 0 and max(values) > 100 * min(values):
                ax.set_xscale("log")  # long and short requests lie decades apart
        ax.set(xlabel=label, ylabel="fraction", title=f"{label.split()[0]} CDF")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
