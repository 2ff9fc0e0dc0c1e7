"""``medha-sim`` end to end in subprocesses, and its one-line usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"run", "long_rule", "counts", "ttft_s", "tpot_s", "e2e_s", "goodput", "throughput"}
REQUEST_KEYS = {
    "id",
    "arrival_s",
    "first_token_s",
    "finish_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "deadline_s",
    "met_deadline",
    "preemptions",
}


def sim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "medha_sched.sim.cli", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=120)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    out = ok(
        sim(
            "gen",
            "--qps",
            "4",
            "--duration",
            "8",
            "--long-fraction",
            "0.1",
            "--seed",
            "1",
            "--max-context",
            "200000",
            "--out",
            "trace.jsonl",
            cwd=d,
        )
    )
    assert "requests" in out and (d / "trace.jsonl").is_file()
    return d


def test_gen_run_plot(workdir: Path) -> None:
    trace = [json.loads(x) for x in (workdir / "trace.jsonl").read_text().splitlines()]
    assert trace and all(
        {"id", "arrival_s", "prompt_tokens", "output_tokens"} <= set(t) for t in trace
    )
    spec = "affine:base=0.004,per_token=4e-5,per_attn=7e-10"
    for policy, extra in (("lars-mp", []), ("fcfs", ["--chunk-size", "0"])):
        out = ok(
            sim(
                "run",
                "--trace",
                "trace.jsonl",
                "--policy",
                policy,
                "--cost-model",
                spec,
                "--target-batch-time",
                "0.05",
                "--spp",
                "2",
                *extra,
                "--out",
                f"runs/{policy}",
                cwd=workdir,
            )
        )
        assert "goodput" in out
        summary = json.loads((workdir / "runs" / policy / "summary.json").read_text())
        assert set(summary) >= SUMMARY_KEYS
        for group in ("all", "short", "long"):
            assert {"p50", "p90", "p99"} <= set(summary["ttft_s"][group])
        assert summary["counts"]["requests"] == len(trace)
        lines = (workdir / "runs" / policy / "requests.jsonl").read_text().splitlines()
        assert len(lines) == len(trace)
        assert set(json.loads(lines[0])) >= REQUEST_KEYS
    ok(sim("plot", "runs/lars-mp", "runs/fcfs", "--out", "cdf.png", cwd=workdir))
    png = (workdir / "cdf.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_compare_writes_table_and_figure(tmp_path: Path) -> None:
    out = ok(
        sim(
            "compare",
            "--policies",
            "fcfs@0,lars-mp",
            "--qps",
            "2,4",
            "--duration",
            "5",
            "--max-context",
            "150000",
            "--cost-model",
            "affine:base=0.004,per_token=4e-5,per_attn=7e-10",
            "--out",
            "sweep",
            cwd=tmp_path,
        )
    )
    assert "| fcfs@0 | 2 |" in out and "| lars-mp | 4 |" in out
    sweep = tmp_path / "sweep"
    rows = (sweep / "compare.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 and rows[0].startswith("policy,qps,")
    assert (sweep / "compare.png").read_bytes().startswith(b"\x89PNG")
    assert (sweep / "runs" / "lars-mp_qps4" / "summary.json").is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--trace", "trace.jsonl", "--out", "x", "--bogus"], "--bogus"),
        (["run", "--trace", "trace.jsonl", "--out", "x", "--policy", "sjf"], "--policy"),
        (["run", "--trace", "trace.jsonl", "--out", "x", "--cost-model", "nope:a=1"], "nope:a=1"),
        (
            ["run", "--trace", "trace.jsonl", "--out", "x", "--cost-model", "affine:base=1"],
            "per_token",
        ),
        (
            [
                "run",
                "--trace",
                "trace.jsonl",
                "--out",
                "x",
                "--cost-model",
                "roofline:model=gpt9,gpu=a100",
            ],
            "gpt9",
        ),
        (["run", "--trace", "trace.jsonl", "--out", "x", "--tp", "0"], "--tp"),
        (["run", "--trace", "trace.jsonl", "--out", "x", "--chunk-size", "-3"], "--chunk-size"),
        (
            ["run", "--trace", "trace.jsonl", "--out", "x", "--admission-delay", "-0.1"],
            "--admission-delay",
        ),
        (["run", "--trace", "missing.jsonl", "--out", "x"], "--trace"),
        (["gen", "--qps", "1", "--out", "t.jsonl"], "--duration"),
        (["gen", "--qps", "abc", "--duration", "1", "--out", "t.jsonl"], "--qps"),
        # numpy's "Maximum allowed dimension exceeded" traceback (more arrivals than an
        # array holds; a MemoryError takes the same path, not tested: it would allocate)
        (["gen", "--qps", "1", "--duration", "1e308", "--out", "t.jsonl"], "cannot draw"),
        (["compare", "--policies", "fcfs@big", "--duration", "1", "--out", "c"], "fcfs@big"),
        (["compare", "--policies", "zzz", "--duration", "1", "--out", "c"], "zzz"),
        # the same load twice ran twice into one run directory (at once with --jobs 2)
        (["compare", "--qps", "0.5,0.50", "--duration", "1", "--out", "c"], "a load repeats"),
        (["plot", "nowhere", "--out", "p.png"], "nowhere"),
    ],
)
def test_bad_flags_and_specs_exit_2_with_one_named_line(
    workdir: Path, args: list[str], needle: str
) -> None:
    proc = sim(*args, cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "error" in lines[0], proc.stderr


def test_bad_trace_line_is_named(tmp_path: Path) -> None:
    good = '{"id": "a", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}'
    bad = '{"id": "b", "arrival_s": 1, "prompt_tokens": 0, "output_tokens": 2}'
    (tmp_path / "t.jsonl").write_text(f"{good}\n{bad}\n")
    proc = sim("run", "--trace", "t.jsonl", "--out", "o", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "t.jsonl line 2: prompt_tokens must be an integer >= 1, got 0" in proc.stderr


def test_console_script_is_registered() -> None:
    from importlib import metadata

    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("medha-sim") == "medha_sched.sim.cli:main"


def test_plot_to_a_format_matplotlib_lacks_is_one_named_line(tmp_path: Path) -> None:
    """``--out fig.txt`` was matplotlib's ValueError traceback (exit 1) after reading the runs."""
    good = '{"id": "a", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}'
    (tmp_path / "t.jsonl").write_text(f"{good}\n")
    ok(sim("run", "--trace", "t.jsonl", "--out", "r", "--quiet", cwd=tmp_path))
    proc = sim("plot", "r", "--out", "fig.txt", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "fig.txt" in lines[0] and "png" in lines[0], proc.stderr
    assert not (tmp_path / "fig.txt").exists()
    ok(sim("plot", "r", "--out", "fig.svg", cwd=tmp_path))
    assert (tmp_path / "fig.svg").is_file()


def test_sessions_whose_first_turn_cannot_fit_are_refused(tmp_path: Path) -> None:
    """A document longer than --max-context wrote an empty trace and exited 0."""
    args = ["sessions", "--sessions", "2", "--turns", "2", "--qps", "1", "--out", "s.jsonl"]
    proc = sim(*args, "--doc-tokens", "100", "--max-context", "50", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "doc_tokens=100" in lines[0] and "max_context=50" in lines[0]
    assert not (tmp_path / "s.jsonl").exists()
    fits = ["--doc-tokens", "100", "--output-tokens", "8", "--max-context", "200"]
    out = ok(sim(*args, *fits, cwd=tmp_path))
    assert "wrote " in out and (tmp_path / "s.jsonl").read_text().strip()
