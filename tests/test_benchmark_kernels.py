"""benchmarks/kernels.py runs on CPU and reports what it promises."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


def test_cpu_quick_benchmark_reports_every_op(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    cmd = [
        sys.executable,
        "benchmarks/kernels.py",
        "--device",
        "cpu",
        "--quick",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| op | shape | backend |" in proc.stdout
    data = json.loads(out.read_text())
    assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["bf16_mm_tflops"] > 0
    for op in ("merge", "decode", "prefill"):
        rows = [r for r in data["rows"] if r["op"] == op and r["backend"] == "medha/torch"]
        assert rows, f"no {op} rows on the torch backend"
        for r in rows:
            assert r["time_us"] > 0 and math.isfinite(r["gbps"]) and r["gbps"] > 0
            assert math.isfinite(r["tflops"]) and math.isfinite(r["pct_ceiling"])


def test_figure_chunking_explains_itself_on_cpu() -> None:
    cmd = [sys.executable, "benchmarks/kernels.py", "--device", "cpu", "--figure-chunking"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "needs a GPU" in proc.stdout


def test_cpu_attention_tiles_quick_compares_both_tilings() -> None:
    cmd = [sys.executable, "benchmarks/cpu_attention_tiles.py", "--quick", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 3")]
    assert len(rows) == 2  # the 37-row chunk, both tilings
    tiles = {cells[2].strip(): int(cells[3]) for cells in rows}
    assert tiles["fixed 4096-key tiles"] == 4096
    assert tiles["sized to the query"] < 4096
    assert all(cells[4].strip().endswith(" ms") for cells in rows)


def test_paged_prefill_benchmark_runs_its_three_launches(tmp_path: Path) -> None:
    """benchmarks/paged_prefill.py (the Triton interpreter here): each shape gets the
    split, unsplit and contiguous times, and the short chunk over many keys is split."""
    import os

    out = tmp_path / "paged_prefill.json"
    cmd = [sys.executable, "benchmarks/paged_prefill.py", "--quick", "--device", "cpu"]
    cmd += ["--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["C"], r["L"]) for r in rows] == [(5, 700), (33, 300)]
    assert rows[0]["splits"] > 1
    for r in rows:
        assert all(r[f"{k} us"] > 0 for k in ("split", "no split", "contiguous"))
        assert r["ok"] and r["max_diff_o"] <= 2e-2 and r["max_diff_lse"] <= 1e-3, r
