"""Summaries against numpy, goodput, failures counted; the JSON result; the table; the plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from medha_runtime.bench.config import BenchConfig
from medha_runtime.bench.metrics import latency_stats, meets, summarize
from medha_runtime.bench.plot import plot_cdfs
from medha_runtime.bench.record import RequestRecord
from medha_runtime.bench.report import format_summary
from medha_runtime.bench.result import result_document, write_result


def done(rid: str, kind: str, ttft: float, tpot: float | None, n: int, **kw) -> RequestRecord:
    e2e = ttft + (tpot or 0.0) * (n - 1)
    itl = [tpot] * (n - 1) if tpot else []
    return RequestRecord(
        id=rid,
        kind=kind,
        prompt_tokens=kw.pop("prompt", 10),
        max_tokens=n,
        arrival_s=0.0,
        start_s=0.0,
        output_tokens=n,
        ttft_s=ttft,
        tpot_s=tpot,
        itl_s=itl,
        e2e_s=e2e,
        **kw,
    )


def failed(rid: str, kind: str = "short") -> RequestRecord:
    return RequestRecord(
        id=rid, kind=kind, prompt_tokens=5, max_tokens=4, arrival_s=0.0, error="HTTP 400: bad"
    )


@pytest.fixture
def records() -> list[RequestRecord]:
    rng = np.random.default_rng(0)
    rs = [
        done(f"s{i}", "short", float(rng.uniform(0.01, 0.2)), float(rng.uniform(0.01, 0.05)), 5)
        for i in range(40)
    ]
    rs += [done(f"l{i}", "long", 1.0 + i, 0.04, 3, prompt=1000) for i in range(5)]
    rs += [done("one", "short", 0.05, None, 1), failed("f1"), failed("f2", "long")]
    return rs


def test_percentiles_match_numpy(records: list[RequestRecord]) -> None:
    s = summarize(records, duration_s=10.0, percentiles=(50, 90, 99, 99.9))
    ok = [r for r in records if r.ok]
    ttft_ms = np.array([r.ttft_s for r in ok]) * 1e3
    t = s["all"]["ttft_ms"]
    assert t["count"] == len(ok) == 46
    for q in (50, 90, 99, 99.9):
        assert t[f"p{q:g}"] == pytest.approx(np.percentile(ttft_ms, q))
    assert t["mean"] == pytest.approx(ttft_ms.mean())
    assert t["median"] == pytest.approx(np.median(ttft_ms))
    assert t["std"] == pytest.approx(ttft_ms.std())
    itl = np.concatenate([np.array(r.itl_s) for r in ok]) * 1e3
    assert s["all"]["itl_ms"]["p90"] == pytest.approx(np.percentile(itl, 90))
    tpot = np.array([r.tpot_s for r in ok if r.tpot_s is not None]) * 1e3
    assert s["all"]["tpot_ms"]["count"] == 45  # the one-token request has no TPOT
    assert s["all"]["tpot_ms"]["p99"] == pytest.approx(np.percentile(tpot, 99))
    long_e2e = np.array([r.e2e_s for r in ok if r.kind == "long"]) * 1e3
    assert s["long"]["e2el_ms"]["p50"] == pytest.approx(np.percentile(long_e2e, 50))


def test_counts_throughput_and_groups(records: list[RequestRecord]) -> None:
    s = summarize(records, duration_s=10.0)
    a, short, long = s["all"], s["short"], s["long"]
    assert (a["requests"], a["completed"], a["failed"]) == (48, 46, 2)
    assert (short["failed"], long["failed"]) == (1, 1)
    assert a["failure_reasons"] == {"HTTP 400: bad": 2}
    assert a["output_tokens"] == 40 * 5 + 5 * 3 + 1
    assert a["output_throughput"] == pytest.approx(a["output_tokens"] / 10.0)
    assert a["request_throughput"] == pytest.approx(4.6)
    assert short["completed"] + long["completed"] == a["completed"]
    only_short = summarize([r for r in records if r.kind == "short"], duration_s=1.0)
    assert set(only_short) == {"all", "short"}
    assert latency_stats([], (50,)) == {
        "count": 0,
        "mean": None,
        "median": None,
        "std": None,
        "min": None,
        "max": None,
        "p50": None,
    }


def test_goodput_counts_requests_meeting_every_slo(records: list[RequestRecord]) -> None:
    slos = {"ttft": 150.0, "tpot": 40.0}
    s = summarize(records, duration_s=8.0, goodput=slos)
    expected = sum(
        r.ok and r.ttft_s * 1e3 <= 150 and (r.tpot_s is None or r.tpot_s * 1e3 <= 40)
        for r in records
    )
    g = s["all"]["goodput"]
    assert 0 < g["good_requests"] == expected < 46
    assert g["fraction"] == pytest.approx(expected / 48)  # failures count against goodput
    assert g["request_goodput"] == pytest.approx(expected / 8.0)
    assert s["long"]["goodput"]["good_requests"] == 0  # TTFT >= 1 s
    assert meets(records[-3], {"tpot": 1.0})  # one token: no TPOT to miss
    assert not meets(records[-1], {"ttft": 1e9})  # a failed request is never good
    assert summarize(records, duration_s=1.0)["all"]["goodput"] is None


def test_own_slo_attainment() -> None:
    rs = [
        done("a", "short", 0.1, 0.01, 3, ttft_slo_s=0.2),
        done("b", "short", 0.3, 0.01, 3, ttft_slo_s=0.2),
        done("c", "short", 0.1, 0.05, 3, tpot_slo_s=0.02),
        done("d", "short", 0.1, 0.05, 3),
    ]
    att = summarize(rs, duration_s=1.0)["all"]["slo_attainment"]
    assert att == {"requests": 3, "met": 1, "fraction": pytest.approx(1 / 3)}


def test_result_file_is_strict_json_and_table_reads(tmp_path: Path, records) -> None:
    config = BenchConfig(request_rate=math.inf, goodput=(("ttft", 100.0),), api_key="secret")
    summary = summarize(records, duration_s=5.0, goodput={"ttft": 100.0})
    doc = result_document(
        config=config.to_json(),
        base_url="http://x",
        model="m",
        started_at="now",
        summary=summary,
        records=records,
    )
    out = tmp_path / "sub" / "r.json"
    write_result(out, doc)
    back = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert back["config"]["request_rate"] == "inf" and back["config"]["api_key"] == "***"
    assert back["config"]["goodput"] == {"ttft": 100.0}
    assert len(back["requests"]) == 48 and back["requests"][-1]["error"] == "HTTP 400: bad"
    assert back["summary"]["all"]["failed"] == 2
    table = format_summary(summary, (50, 90, 99))
    assert "TTFT p99 (ms)" in table and "Goodput (req/s)" in table
    assert "failed x2: HTTP 400: bad" in table
    png = tmp_path / "cdf.png"
    plot_cdfs(records, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"dataset_name": "nope"}, "dataset_name must be one of"),
        ({"dataset_name": "trace"}, "needs --dataset-path"),
        ({"request_rate": 0.0}, "request_rate must be > 0"),
        ({"burstiness": float("inf")}, "burstiness must be a finite number > 0, got inf"),
        ({"goodput": (("ttfx", 1.0),)}, "goodput metric must be one of"),
        ({"goodput": (("ttft", -1.0),)}, "goodput limit for ttft must be > 0 ms, got -1.0"),
        ({"num_prompts": 0}, "num_prompts must be an integer >= 1, got 0"),
        ({"percentiles": (50, 100)}, "percentiles must lie in"),
        ({"base_url": "localhost:8000"}, "must start with http"),
        ({"max_prompt_tokens": 5}, "do not apply to the random dataset"),
    ],
)
def test_config_errors_name_the_bad_value(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(**kw)


def test_server_error_histogram_quantiles_and_difference() -> None:
    from medha_runtime.bench.server_metrics import ErrorHistogram, summarize_prediction_error

    inf = float("inf")
    before = ErrorHistogram((0.1, 0.2, inf), (4.0, 4.0, 4.0), 0.2, None)
    after = ErrorHistogram((0.1, 0.2, inf), (4.0, 14.0, 16.0), 2.6, 0.15)
    run = after.since(before)  # 10 steps in (0.1, 0.2], 2 above 0.2
    assert run.count == 12 and run.total == pytest.approx(2.4)
    assert run.quantile(0.5) == pytest.approx(0.1 + 0.1 * 6 / 10)
    assert run.quantile(0.9) == 0.2  # in the open last bucket: its lower bound
    got = summarize_prediction_error(run)
    assert got == {"steps": 12, "mean": pytest.approx(0.2), "p50": pytest.approx(0.16),
                   "p90": 0.2, "median_last_100": 0.15}  # fmt: skip
    assert summarize_prediction_error(before.since(before)) is None
