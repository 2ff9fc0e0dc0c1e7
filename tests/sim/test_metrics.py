"""Per-request metrics and the summary."""

from __future__ import annotations

import numpy as np
import pytest

from medha_sched.sim.metrics import IterationRecord, RequestRecord, percentile, summarize


def rec(
    rid: str, prompt: int, out: int, first: float | None, finish: float | None, **kw
) -> RequestRecord:
    return RequestRecord(rid, 1.0, prompt, out, first_token_s=first, finish_s=finish, **kw)


def test_percentile_matches_numpy_linear_interpolation() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = list(rng.exponential(size=n))
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_request_metrics() -> None:
    r = rec("a", 10, 5, first=1.5, finish=2.5, deadline_s=1.4)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.25)
    assert r.e2e_s == pytest.approx(1.5)
    assert not r.met_deadline  # first token at 1.5 > deadline 1.4
    one = rec("b", 10, 1, first=1.2, finish=1.2, deadline_s=1.5)
    assert one.tpot_s is None and one.met_deadline
    assert rec("c", 10, 3, None, None, rejected="too long").to_json(100)["rejected"] is True


def test_summary_splits_short_and_long_and_counts_rejections() -> None:
    records = [
        rec("s1", 100, 3, first=1.1, finish=1.3, deadline_s=2.0),
        rec("s2", 200, 3, first=1.3, finish=1.7, deadline_s=1.2),
        rec("l1", 50_000, 2, first=5.0, finish=5.5, deadline_s=9.0),
        rec("l2", 90_000, 2, first=None, finish=None, rejected="too long"),
    ]
    iterations = [
        IterationRecord(0, 1.0, 0.2, 0, 1, 100, 0),
        IterationRecord(1, 1.2, 0.4, 1, 1, 50, 0),
    ]
    s = summarize(records, iterations, long_threshold=32768, num_stages=2)
    assert s["counts"] == {
        "requests": 4,
        "finished": 3,
        "rejected": 1,
        "short": 2,
        "long": 2,
        "preemptions": 0,
        "iterations": 2,
    }
    assert s["ttft_s"]["short"]["p50"] == pytest.approx(0.2)
    assert s["ttft_s"]["long"]["n"] == 1 and s["ttft_s"]["long"]["p99"] == pytest.approx(4.0)
    assert s["tpot_s"]["all"]["n"] == 3
    assert s["goodput"] == pytest.approx(2 / 4)  # s1 and l1; the rejected one counts as a miss
    assert s["deadline_met"]["short"] == pytest.approx(0.5)
    assert "32768" in s["long_rule"]
    tp = s["throughput"]
    assert tp["makespan_s"] == pytest.approx(4.5)
    assert tp["requests_per_s"] == pytest.approx(3 / 4.5)
    assert tp["tokens_per_s"] == pytest.approx((100 + 200 + 50_000 + 3 + 3 + 2) / 4.5)
    assert tp["stage_utilization"] == pytest.approx(0.3 / 4.5)
    assert iterations[1].tokens == 51
    batches = s["batches"]
    assert batches["n"] == 2 and batches["mean_decodes"] == pytest.approx(0.5)
    assert batches["mean_prefill_tokens"] == pytest.approx(75)
    assert batches["with_prefill_fraction"] == 1.0 and batches["multi_prefill_fraction"] == 0.0
    assert batches["predicted_s"]["p50"] == pytest.approx(0.3)


def test_empty_groups_give_none_not_errors() -> None:
    s = summarize([rec("s", 10, 2, 1.5, 2.0, deadline_s=3.0)], [], long_threshold=100)
    assert s["ttft_s"]["long"] == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert s["deadline_met"]["long"] is None
