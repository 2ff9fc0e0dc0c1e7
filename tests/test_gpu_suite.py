"""benchmarks/gpu_suite.py: its stages run on the CPU (--dry-run), and its reports add up."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
# loaded by path: putting benchmarks/ on sys.path would shadow packages named like its
# scripts (transformers probes for a `kernels` package)
_spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
gs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gs)


def test_dry_run_env_and_kernels(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/gpu_suite.py", "--out", str(tmp_path), "--dry-run"]
    cmd += ["--stage", "env", "--stage", "kernels"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| env | done |" in proc.stdout and "| kernels | done |" in proc.stdout
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["status"] == "done" and env["dry_run"] and env["ok"]
    assert env["imports"]["failed"] == {} and env["imports"]["ok"] > 50
    assert env["torch"] and env["device"]["name"] == "cpu" and "torch" in env["medha_backends"]
    assert env["ceilings"]["copy_gbps"] > 0 and env["ceilings"]["bf16_mm_tflops"] > 0
    kern = json.loads((tmp_path / "kernels.json").read_text())
    assert kern["status"] == "done"
    for op in ("merge", "decode", "prefill"):
        rows = [r for r in kern["rows"] if r["op"] == op and r["backend"] == "medha/torch"]
        assert rows and all(r["time_us"] > 0 and math.isfinite(r["gbps"]) for r in rows), op
    checks = kern["report"]["checks"]
    assert {c["op"] for c in checks} == {"merge", "decode", "prefill"}
    assert all(c["value"] is None or c["value"] > 0 for c in checks)
    for stage in ("env", "kernels"):
        assert (tmp_path / f"{stage}.log").read_text().strip()


def test_a_failing_stage_is_recorded_and_the_next_still_runs(tmp_path: Path) -> None:
    # --model names no config: the runtime stage fails at once; env runs after it regardless
    cmd = [sys.executable, "benchmarks/gpu_suite.py", "--out", str(tmp_path), "--dry-run"]
    cmd += ["--stage", "runtime", "--stage", "env", "--model", "random:/nonexistent"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    runtime = json.loads((tmp_path / "runtime.json").read_text())
    assert runtime["status"] == "error" and "nonexistent" in runtime["error"]
    assert json.loads((tmp_path / "env.json").read_text())["status"] == "done"
    assert "| runtime | error |" in proc.stdout and "| env | done |" in proc.stdout


def test_summarize_outcomes_flags_cuda_gated_skips() -> None:
    rows = [
        {"test": "a", "when": "call", "outcome": "passed", "seconds": 0.1},
        {"test": "b", "when": "setup", "outcome": "skipped", "seconds": 0, "reason": "needs CUDA"},
        {"test": "c", "when": "setup", "outcome": "skipped", "seconds": 0, "reason": "no gguf"},
        {"test": "d", "when": "call", "outcome": "failed", "seconds": 2.0, "reason": "E boom"},
    ]
    s = gs.summarize_outcomes(rows, 1)
    assert s["summary"] == {"failed": 1, "passed": 1, "skipped": 2}
    assert s["cuda_gated_skips"] == 1 and [x["test"] for x in s["skipped"]] == ["b", "c"]
    assert s["failed"] == [{"test": "d", "when": "call", "reason": "E boom"}]
    assert not s["ok"] and s["slowest"][0]["test"] == "d"
    assert gs.summarize_outcomes(rows[:1] + rows[2:3], 0)["ok"]
    assert not gs.summarize_outcomes([], 0)["ok"]  # no test ran


def _row(op: str, shape: str, backend: str, t_us: float, gbps: float, tflops: float) -> dict:
    return {
        "op": op,
        "shape": shape,
        "backend": backend,
        "time_us": t_us,
        "gbps": gbps,
        "tflops": tflops,
        "pct_ceiling": 0.0,
    }


def test_kernel_report_checks_the_best_own_backend_against_flashinfer() -> None:
    ceil = {"copy_gbps": 1000.0, "bf16_mm_tflops": 500.0, "mm_tflops": 500.0}
    merge = "T=16384 H=32 D=128"
    small = "T=4096 H=32 D=128"
    rows = [
        _row("merge", merge, "medha/triton", 10.0, 950.0, 0.1),
        _row("merge", merge, "medha/torch", 50.0, 190.0, 0.1),
        _row("merge", merge, "medha/flashinfer", 5.0, 1900.0, 0.1),  # the adapter: not ours
        _row("merge", merge, "flashinfer", 12.0, 790.0, 0.1),
        _row("merge", small, "medha/triton", 10.0, 100.0, 0.1),  # T < 16K: no target
        _row("prefill", "c=512 L=4096 Hq=32 Hkv=8 D=128", "medha/triton", 10.0, 1.0, 300.0),
        _row("prefill", "c=32 L=4096 Hq=32 Hkv=8 D=128", "medha/triton", 10.0, 1.0, 30.0),
    ]
    rep = gs.kernel_report(rows, ceil, dry=False)
    checks = {(c["op"], c["shape"], c["measure"]): c for c in rep["checks"]}
    bw = checks[("merge", merge, "of copy bandwidth")]
    assert bw["backend"] == "medha/triton" and bw["value"] == pytest.approx(0.95) and bw["met"]
    fi = checks[("merge", merge, "x FlashInfer")]
    assert fi["value"] == pytest.approx(1.2) and fi["met"]
    assert not any(shape == small for _, shape, _ in checks)
    rate = checks[("prefill", "c=512 L=4096 Hq=32 Hkv=8 D=128", "of bf16 rate")]
    assert rate["value"] == pytest.approx(0.6) and rate["met"] is False
    assert checks[("prefill", "c=512 L=4096 Hq=32 Hkv=8 D=128", "x FlashInfer")]["met"] is None
    assert len(rep["checks"]) == 4  # chunk 32 has no target


def test_chunking_report_overhead_at_the_longest_context() -> None:
    rows = [
        _row("prefill", f"c={c} L={n} Hq=32 Hkv=8 D=128", "medha/triton", t, 1, 1)
        for n, c, t in [(1 << 20, 32, 32 * 1.10), (1 << 20, 2048, 2048 * 1.0), (1 << 17, 32, 5.0)]
    ]
    rep = gs.chunking_report(rows, small=32, large=2048)
    (check,) = rep["checks"]
    assert check["context"] == 1 << 20 and check["overhead"] == pytest.approx(0.10)
    assert check["met"] is False  # 10% > 8%
    short = next(s for s in rep["series"] if s["context"] == 1 << 17)
    assert short["overhead"] is None


def test_runtime_metrics_from_bench_and_step_logs(tmp_path: Path) -> None:
    reqs = [
        {"id": "s0", "start_s": 0.0, "e2e_s": 1.0, "ttft_s": 0.1, "tpot_s": 0.01,
         "prompt_tokens": 10, "output_tokens": 5},
        {"id": "s1", "start_s": 1.0, "e2e_s": 1.0, "ttft_s": 0.3, "tpot_s": 0.03,
         "prompt_tokens": 10, "output_tokens": 5},
        {"id": "L0", "start_s": 0.5, "e2e_s": 3.5, "ttft_s": 3.0, "tpot_s": 0.02,
         "prompt_tokens": 100, "output_tokens": 5},
        {"id": "s2", "start_s": 2.0, "e2e_s": 0.1, "error": "timeout",
         "prompt_tokens": 10, "output_tokens": 5},
    ]  # fmt: skip
    result = tmp_path / "bench.json"
    result.write_text(json.dumps({"requests": reqs}))
    m = gs.bench_metrics(result)
    assert m["requests"] == 4 and m["lost"] == 1 and m["lost_ids"] == ["s2"]
    assert m["ttft_p50_short_s"] == pytest.approx(0.2) and m["ttft_long_s"] == [3.0]
    assert m["tokens_per_s"] == pytest.approx(135 / 4.0)
    steps = tmp_path / "steps.jsonl"
    recs = [(0.1, 0.12, [[512, 0]]), (0.01, 0.01, [[1, 10], [1, 20]]), (0.02, 0.01, [[1, 5]])]
    steps.write_text(
        "".join(
            json.dumps({"step": i, "start_s": i, "schedule_s": 0, "execute_s": e, "finish_s": 0,
                        "predicted_s": p, "items": items}) + "\n"
            for i, (e, p, items) in enumerate(recs)
        )
    )  # fmt: skip
    err = gs.step_prediction_error(steps)
    assert err["steps"] == 3 and err["with_prefill"]["median_abs"] == pytest.approx(0.2)
    assert err["decode_only"]["steps"] == 2 and err["decode_only"]["median_abs"] == pytest.approx(
        0.25
    )
    rep = gs.runtime_report(
        {"lars-mp": m | {"ttft_p90_short_s": 0.1}, "fcfs": m | {"ttft_p90_short_s": 4.0}}
    )
    (check,) = rep["checks"]
    assert check["ttft_p90_ratio"] == pytest.approx(40.0) and check["lost"] == 2
    assert check["met"] is False  # lost requests fail the target whatever the ratio


def test_mixed_trace_holds_the_long_prompts(tmp_path: Path) -> None:
    plan = {
        "duration_s": 30.0,
        "short_qps": 2.0,
        "short_prompt": [64, 128],
        "short_output": [4, 8],
        "long_tokens": [131072, 262144],
        "long_output": 16,
    }
    path = tmp_path / "trace.jsonl"
    gs.make_mixed_trace(plan, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    longs = [r["prompt_tokens"] for r in rows if r["id"].startswith("L")]
    shorts = [r for r in rows if r["id"].startswith("s")]
    assert longs == [131072, 262144] and 30 < len(shorts) < 100
    assert all(64 <= r["prompt_tokens"] <= 128 for r in shorts)
    assert [r["arrival_s"] for r in rows] == sorted(r["arrival_s"] for r in rows)


def test_pytest_args_that_name_test_paths_choose_what_runs() -> None:
    """docs/gpu.md splits a slow correctness run with ``--pytest-args "tests/kernels
    tests/parallel"``: those paths replace the whole ``tests`` folder; options alone
    (their values included) keep it."""
    targets = gs.pytest_targets
    assert targets("tests/kernels tests/parallel", False) == ["tests/kernels", "tests/parallel"]
    assert targets("tests/test_gpu_suite.py::test_x -x", False) == [
        "tests/test_gpu_suite.py::test_x",
        "-x",
    ]
    assert targets("-k merge -x", False) == ["-k", "merge", "-x", "tests"]
    assert targets(None, False) == ["tests"]
    assert targets("-x", True) == ["-x", *gs.DRY_TESTS]
