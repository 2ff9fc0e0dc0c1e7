"""benchmarks/scheduler.py runs small, checks its three schedulers agree and
prints one row per implementation (with ``--repeats``: medians and p99 ranges)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scheduler.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_scheduler_benchmark_repeats_print_medians_and_ranges() -> None:
    proc = _run(
        "--iters", "8", "--waiting", "40", "--decodes", "16", "--policies", "lars",
        "--impls", "new", "reference", "--repeats", "2", "--in-process",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[-3:] == ["p99", "range", "us"]
    rows = [ln.split() for ln in lines[1:] if ln.startswith("lars ")]
    assert [r[3] for r in rows] == ["new", "reference"]  # one row each, after both runs
    for r in rows:
        p99 = float(r[5])
        lo, hi = (float(x) for x in r[-1].split("-"))
        assert lo <= p99 <= hi  # the median of two runs lies within their range
    assert rows[0][-2] == "1.00"  # new against itself
    assert "formed the same batches in the first 8 steps" in lines[-1]


def test_scheduler_benchmark_one_run_keeps_its_columns() -> None:
    proc = _run(
        "--iters", "4", "--waiting", "20", "--decodes", "8", "--policies", "lars-mp",
        "--impls", "new", "--in-process",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head, row = proc.stdout.splitlines()[:2]
    assert head.split()[-3:] == ["p50", "x", "new"]
    assert re.match(r"lars-mp\s+8\s+20\s+new\s", row)


def test_scheduler_benchmark_refuses_zero_repeats() -> None:
    proc = _run("--repeats", "0")
    assert proc.returncode == 2
    assert "--repeats must be at least 1, got 0" in proc.stderr
