"""Summaries of a run: latency percentiles (ms), throughput, goodput, failures.

Latencies are over completed requests only; failed ones are counted (with
their reasons) and count against goodput. Throughputs divide by the run's
duration, from the first send to the last answer, for every group (so the
short and long rows add up to the total).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from medha_runtime.bench.record import RequestRecord

GROUPS = ("all", "short", "long")


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
    goodput: Mapping[str, float] | None = None,
) -> dict[str, dict[str, Any]]:
    """Summaries of all requests and of the short and long ones (empty groups left out)."""
    out = {}
    for group in GROUPS:
        members = [r for r in records if group in ("all", r.kind)]
        if members or group == "all":
            out[group] = group_summary(
                members, duration_s=duration_s, percentiles=percentiles, goodput=goodput
            )
    return out


def group_summary(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    percentiles: Sequence[float],
    goodput: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failure_reasons": failure_reasons(records),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "request_throughput": _rate(len(done), duration_s),
        "output_throughput": _rate(output, duration_s),
        "total_token_throughput": _rate(prompt + output, duration_s),
        "ttft_ms": latency_stats((r.ttft_s for r in done), percentiles),
        "tpot_ms": latency_stats((r.tpot_s for r in done), percentiles),
        "itl_ms": latency_stats((x for r in done for x in r.itl_s), percentiles),
        "e2el_ms": latency_stats((r.e2e_s for r in done), percentiles),
        "goodput": goodput_summary(records, goodput, duration_s) if goodput else None,
        "slo_attainment": slo_attainment(records),
    }


def latency_stats(values_s: Iterable[float | None], percentiles: Sequence[float]) -> dict[str, Any]:
    """count, mean, median, std, min, max and ``p<q>`` of the values, in milliseconds."""
    ms = np.asarray([v for v in values_s if v is not None], dtype=np.float64) * 1e3
    keys = ["mean", "median", "std", "min", "max", *(f"p{q:g}" for q in percentiles)]
    if ms.size == 0:
        return {"count": 0, **dict.fromkeys(keys)}
    values = [ms.mean(), np.median(ms), ms.std(), ms.min(), ms.max()]
    values += [np.percentile(ms, q) for q in percentiles]
    return {"count": int(ms.size), **{k: float(v) for k, v in zip(keys, values, strict=True)}}


def meets(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Completed and within every given SLO (a one-token request has no TPOT to miss)."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2e_s}
    return all(
        values[metric] is None or values[metric] * 1e3 <= limit  # type: ignore[operator]
        for metric, limit in slos_ms.items()
    )


def goodput_summary(
    records: Sequence[RequestRecord], slos_ms: Mapping[str, float], duration_s: float
) -> dict[str, Any]:
    """Requests meeting all ``slos_ms`` (vLLM's ``--goodput``): count, fraction, per second."""
    good = sum(meets(r, slos_ms) for r in records)
    return {
        "slos_ms": dict(slos_ms),
        "good_requests": good,
        "fraction": good / len(records) if records else None,
        "request_goodput": _rate(good, duration_s),
    }


def slo_attainment(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Of the requests that carry their own SLOs (a trace's), how many met them."""
    with_slo = [r for r in records if r.ttft_slo_s is not None or r.tpot_slo_s is not None]
    if not with_slo:
        return None
    met = sum(
        meets(r, {k: v * 1e3 for k, v in (("ttft", r.ttft_slo_s), ("tpot", r.tpot_slo_s)) if v})
        for r in with_slo
    )
    return {"requests": len(with_slo), "met": met, "fraction": met / len(with_slo)}


def failure_reasons(records: Iterable[RequestRecord], top: int = 10) -> dict[str, int]:
    """The most common error messages and their counts."""
    counts = Counter((r.error or "")[:300] for r in records if not r.ok)
    return dict(counts.most_common(top))


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0
