"""benchmarks/parallel.py --quick runs, prints its tables and writes sane JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_parallel_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "parallel.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "parallel.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "## SPP" in proc.stdout and "## KVP" in proc.stdout
    res = json.loads(out.read_text())
    spp = res["spp"]
    assert spp["speedup"] > 0 and 1 < spp["ideal_speedup"] < 2
    for key in ("stages_1", "stages_2"):
        assert spp[key]["wall_s"] > 0
        assert 0 <= spp[key]["comm_fraction"] <= 1
        assert all(c > 0 for c in spp[key]["compute_s_per_rank"])
    assert len(spp["stages_2"]["compute_s_per_rank"]) == 2
    rows = res["kvp"]
    assert {r["groups"] for r in rows} == {1, 2, 3}
    for row in rows:
        assert row["latency_ms"] > 0 and row["compute_ms"] > 0
        assert 0 <= row["comm_fraction"] <= 1
        assert row["max_abs_err"] < 1e-4  # the sharded + merged attention is exact
