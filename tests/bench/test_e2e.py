"""``medha-runtime bench`` against the real server (``serve tiny``), as a user runs it."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from medha_runtime.bench.config import BenchConfig
from medha_runtime.bench.session import run_session
from medha_runtime.cli import main
from tests.server.conftest import Server, free_port, start_server, stop_server

KEY = "bench-key"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server(api_key=KEY)
    try:
        yield s
    finally:
        stop_server(s)


def bench(server: Server, tmp_path: Path, *args: str) -> tuple[str, dict]:
    result, plot = tmp_path / "result.json", tmp_path / "cdf.png"
    cmd = [sys.executable, "-m", "medha_runtime", "bench", "--base-url", server.url]
    cmd += ["--api-key", KEY, "--no-progress", "--result-file", str(result), "--plot", str(plot)]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert plot.read_bytes()[:4] == b"\x89PNG"
    return proc.stdout, json.loads(result.read_text())


def check_all_completed(doc: dict, n: int) -> None:
    assert doc["summary"]["all"]["completed"] == n and doc["summary"]["all"]["failed"] == 0
    assert len(doc["requests"]) == n
    for r in doc["requests"]:
        assert r["error"] is None, r
        assert r["output_tokens"] == r["max_tokens"], r  # ignore_eos: exactly max_tokens
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["start_s"] >= r["arrival_s"] - 1e-3
        if r["output_tokens"] > 1:
            expected = (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
            assert r["tpot_s"] == pytest.approx(expected)
    ttft = doc["summary"]["all"]["ttft_ms"]
    assert ttft["count"] == n and ttft["p50"] <= ttft["p99"]
    assert doc["summary"]["all"]["output_throughput"] > 0


def test_mixed_dataset(server: Server, tmp_path: Path) -> None:
    out, doc = bench(
        server, tmp_path,
        "--dataset-name", "mixed", "--num-prompts", "12", "--long-fraction", "0.5",
        "--max-prompt-tokens", "96", "--max-output-tokens", "5", "--request-rate", "100",
        "--goodput", "ttft:60000", "e2el:120000",
    )  # fmt: skip
    check_all_completed(doc, 12)
    assert doc["model"] == "tiny" and doc["config"]["dataset_name"] == "mixed"
    kinds = {r["kind"] for r in doc["requests"]}
    assert kinds == {"short", "long"}
    summary = doc["summary"]
    assert summary["short"]["requests"] + summary["long"]["requests"] == 12
    assert summary["all"]["goodput"]["good_requests"] == 12
    long_prompts = [r["prompt_tokens"] for r in doc["requests"] if r["kind"] == "long"]
    assert max(long_prompts) <= 96
    assert "Benchmark result" in out and "TTFT p99 (ms)" in out
    error = doc["server"]["prediction_error"]  # the run's own steps, read from /metrics
    assert error["steps"] >= 1 and 0.0 <= error["p50"] <= error["p90"]
    assert "step-time prediction error (server, " in out


def test_trace_dataset_text_prompts(server: Server, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "id": f"t{i}",
            "arrival_s": 0.02 * i,
            "prompt_tokens": 8 + 3 * i,
            "output_tokens": 2 + i % 4,
        }
        | ({"ttft_slo_s": 60.0, "priority": 1} if i % 2 else {})
        for i in range(12)
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    _, doc = bench(
        server, tmp_path, "--dataset-name", "trace", "--dataset-path", str(trace),
        "--prompt-format", "text", "--long-threshold", "30",
    )  # fmt: skip
    check_all_completed(doc, 12)
    by_id = {r["id"]: r for r in doc["requests"]}
    assert set(by_id) == {x["id"] for x in lines}
    for x in lines:
        assert by_id[x["id"]]["arrival_s"] == pytest.approx(x["arrival_s"])  # the trace's times
        assert by_id[x["id"]]["max_tokens"] == x["output_tokens"]
        assert abs(by_id[x["id"]]["prompt_tokens"] - x["prompt_tokens"]) <= 1
    assert doc["summary"]["all"]["slo_attainment"]["requests"] == 6
    assert doc["summary"]["long"]["requests"] == sum(x["prompt_tokens"] > 30 for x in lines)


def test_http_errors_are_recorded_per_request(server: Server, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"id": "ok", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
        '{"id": "huge", "arrival_s": 0, "prompt_tokens": 400, "output_tokens": 2}\n'
    )
    config = BenchConfig(
        base_url=server.url + "/v1",
        api_key=KEY,
        dataset_name="trace",
        dataset_path=str(trace),
        result_file=str(tmp_path / "r.json"),
        progress=False,
    )
    assert run_session(config, log=lambda line: None) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    by_id = {r["id"]: r for r in doc["requests"]}
    assert by_id["ok"]["error"] is None
    assert by_id["huge"]["error"].startswith("HTTP 400: ")
    assert "maximum context length" in by_id["huge"]["error"]  # the server's own message
    assert doc["summary"]["all"]["failed"] == 1


def test_max_concurrency_and_chunk_counting(server: Server, tmp_path: Path) -> None:
    config = BenchConfig(
        base_url=server.url,
        api_key=KEY,
        num_prompts=4,
        random_input_len=6,
        random_output_len=3,
        max_concurrency=1,
        stream_usage=False,  # no usage chunk: tokens are counted from content chunks
        result_file=str(tmp_path / "r.json"),
        progress=False,
    )
    assert run_session(config, log=lambda line: None) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["requests"]
    assert all(r["error"] is None and 1 <= r["output_tokens"] <= 3 for r in rows)
    rows.sort(key=lambda r: r["start_s"])
    for before, after in itertools.pairwise(rows):  # one at a time
        assert after["start_s"] >= before["start_s"] + before["e2e_s"] - 1e-3


def test_wrong_key_and_unreachable_server_are_one_line(server: Server, capsys) -> None:
    assert main(["bench", "--base-url", server.url, "--api-key", "wrong", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HTTP 401" in err[0]
    assert main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("medha-runtime bench: error: cannot reach")


def test_bad_flags_are_named(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--goodput", "ttft:-3"])
    assert exc.value.code == 2
    assert "argument --goodput: expected a finite number > 0, got '-3'" in capsys.readouterr().err


def test_a_plot_format_matplotlib_lacks_is_refused_before_the_run(capsys) -> None:
    """``--plot cdf.txt`` failed with matplotlib's error only after the whole run."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the run would fail first
    assert main(["bench", "--base-url", url, "--no-progress", "--plot", "cdf.txt"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plot 'cdf.txt': matplotlib cannot write .txt" in err[0], err
