"""What the server itself says about a run: its step-time prediction error.

A Medha server exposes ``medha:step_time_prediction_relative_error`` (a
histogram, one observation per executed step) and the median of its last 100
steps as a gauge on ``GET /metrics``. The benchmark reads the histogram before
and after the run, so the report covers only the run's own steps. A server
without these metrics (another engine, or metrics disabled) gives ``None``
and the report says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import httpx

HISTOGRAM = "medha:step_time_prediction_relative_error"
MEDIAN_GAUGE = "medha:step_time_prediction_relative_error_median"


@dataclass(frozen=True, slots=True)
class ErrorHistogram:
    """Cumulative bucket counts of the histogram, summed over its label sets.

    Attributes:
        bounds: upper bucket bounds, increasing, the last ``inf``.
        counts: cumulative observations at or under each bound.
        total: sum of all observed errors.
        median_last_100: the server's gauge, if it has one.
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total: float
    median_last_100: float | None

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, before: ErrorHistogram | None) -> ErrorHistogram:
        """The observations made after ``before`` (same buckets)."""
        if before is None or before.bounds != self.bounds:
            return self
        counts = tuple(a - b for a, b in zip(self.counts, before.counts, strict=True))
        return ErrorHistogram(self.bounds, counts, self.total - before.total, self.median_last_100)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, linear inside its bucket (Prometheus's rule)."""
        n = self.count
        if n <= 0:
            return None
        rank = q * n
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound
                inside = count - lower_count
                frac = (rank - lower_count) / inside if inside > 0 else 1.0
                return lower_bound + (bound - lower_bound) * frac
            lower_bound, lower_count = bound, count
        return lower_bound


def scrape_prediction_error(http: httpx.Client, root: str) -> ErrorHistogram | None:
    """Read the histogram from ``root/metrics``; None if the server has none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = http.get(f"{root}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    buckets: dict[float, float] = {}
    total, median, seen = 0.0, None, False
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name == f"{HISTOGRAM}_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
                seen = True
            elif sample.name == f"{HISTOGRAM}_sum":
                total += sample.value
            elif sample.name == MEDIAN_GAUGE:
                median = sample.value
    if not seen:
        return None
    bounds = tuple(sorted(buckets))
    return ErrorHistogram(bounds, tuple(buckets[b] for b in bounds), total, median)


def settled_prediction_error(
    http: httpx.Client,
    root: str,
    before: ErrorHistogram | None,
    *,
    wait_s: float = 3.0,
    poll_s: float = 0.25,
) -> ErrorHistogram | None:
    """The histogram once the run's last steps reached it.

    The server publishes step errors with its periodic heartbeat, so a scrape
    right after the last answer can miss the last steps. Poll until the count
    has grown past ``before`` and then held still for one poll, or ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    last = scrape_prediction_error(http, root)
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = scrape_prediction_error(http, root)
        grown = now is not None and now.count > (before.count if before else 0.0)
        if grown and last is not None and now.count == last.count:
            return now
        last = now
    return last


def summarize_prediction_error(hist: ErrorHistogram | None) -> dict[str, float | None] | None:
    """``{"steps", "mean", "p50", "p90", "median_last_100"}`` of a run, or None."""
    if hist is None or hist.count <= 0:
        return None
    return {
        "steps": hist.count,
        "mean": hist.total / hist.count,
        "p50": hist.quantile(0.5),
        "p90": hist.quantile(0.9),
        "median_last_100": hist.median_last_100,
    }


def format_prediction_error(summary: dict[str, float | None] | None) -> str:
    """One report line."""
    if summary is None:
        return "step-time prediction error: the server exposes none"

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    return (
        f"step-time prediction error (server, {int(summary['steps'] or 0)} steps): "
        f"p50 {pct(summary['p50'])}, p90 {pct(summary['p90'])}, mean {pct(summary['mean'])}; "
        f"median of the last 100 {pct(summary['median_last_100'])}"
    )
