"""The GPU suite: make every CUDA path run, then measure kernels and server against the targets.

Five stages, each bounded by ``--budget-s`` (default: 90, 420, 300, 200 and 500 s,
``BUDGETS``, so that env + correctness, kernels + chunking and runtime each fit one
10-minute device call) and each runnable alone (``--stage NAME``, repeatable) or all in turn
(``--all``; every stage then runs in its own process, so one that crashes or
wedges the GPU does not take the next with it):

- ``env``: Python, torch, CUDA, Triton, FlashInfer, nvcc and the card; every
  module of the four packages imported (the lowest-torch check: the device has
  torch 2.11); copy bandwidth (read + write) and bf16 matmul rate measured.
- ``correctness``: the whole pytest suite with CUDA visible; every skip listed,
  CUDA-gated skips flagged (none may remain); JUnit XML beside the JSON.
- ``kernels``: ``benchmarks/kernels.py``'s merge, paged decode (KV 4K-1M) and
  chunked prefill, every medha backend next to FlashInfer, SDPA and flex: %
  of the measured bandwidth / bf16 rate and the ratio to FlashInfer.
- ``chunking``: one Llama-3-8B attention layer (32 q / 8 KV heads, dim 128,
  bf16) per token for chunks 32-4096 at 128K, 512K and 1M keys: the chunk-32
  over chunk-2048 overhead at 1M (the paper's figure; target <= 8%).
- ``runtime``: a random-weight Llama-3-8B (``random:benchmarks/models/llama3-8b-1m``)
  in bf16: ``medha-runtime profile``; then ``serve`` under ``lars-mp`` and
  non-preemptive FCFS (``--chunk-size 0``) on one mixed trace (short chats plus
  128K-256K prompts), replayed by ``medha-runtime bench``: short P50/P90 TTFT,
  TPOT, throughput, lost requests, and the prediction error of the cost model
  each server ran with (from its step log: whatever model it used).

Every stage writes ``OUT/<stage>.json`` (rewritten as results come, so a stage
killed at the limit keeps what it measured) and ``OUT/<stage>.log``;
``correctness`` adds ``correctness.junit.xml``, ``runtime`` adds
``runtime.tar.gz`` (server logs, step logs, bench results) and
``runtime.profile.json`` (reusable with ``--profile``).

``--dry-run`` runs the same code on the CPU with tiny shapes, a test subset and
a tiny random model, in a few minutes: it proves the script, not the numbers.

    python benchmarks/gpu_suite.py --out /tmp/gpu --all --dry-run
    python benchmarks/gpu_suite.py --out $OUT --stage env --stage correctness
    python benchmarks/gpu_suite.py --out $OUT --stage runtime --runtime-parts lars-mp,fcfs \\
        --profile .gpu/runtime.profile.json

See docs/gpu.md for the device session's exact steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pkgutil
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
PY = sys.executable
STAGES = ("env", "correctness", "kernels", "chunking", "runtime")
#: seconds per stage unless --budget-s: env + correctness, kernels + chunking and runtime
#: each fit one 10-minute device call
BUDGETS = {"env": 90.0, "correctness": 420.0, "kernels": 300.0, "chunking": 200.0, "runtime": 500.0}
PACKAGES = ("medha_sched", "medha_kernels", "medha_parallel", "medha_runtime")
LLAMA3_8B = "random:benchmarks/models/llama3-8b-1m"
K, M = 1024, 1024 * 1024
GIB = 2**30
CUDA_GATED = re.compile(r"cuda|gpu|flashinfer|nvcc|triton|device", re.IGNORECASE)
TARGETS = {
    "merge_bw": 0.90,  # merge, bf16, T >= 16K: fraction of copy bandwidth, and >= 1.0x FlashInfer
    "decode_bw": 0.90,  # decode, KV 4K-1M: fraction of copy bandwidth
    "prefill_rate": 0.65,  # chunked prefill, chunk >= 512: fraction of bf16 rate, >= 1.0x FI
    "chunk_overhead": 0.08,  # chunk-32 per-token time over chunk-2048's at 1M keys, minus 1
    "ttft_p90_ratio": 30.0,  # fcfs@0 short P90 TTFT / lars-mp's
}


# ---------------------------------------------------------------------- one stage's record
class Stage:
    """A stage's JSON document and log; ``save()`` rewrites the JSON after each result."""

    def __init__(self, name: str, out: Path, budget_s: float, dry_run: bool) -> None:
        self.name, self.out, self.budget_s = name, out, budget_s
        self.t0 = time.monotonic()
        self.doc: dict[str, Any] = {
            "stage": name,
            "status": "running",
            "dry_run": dry_run,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "budget_s": budget_s,
        }
        self._log = (out / f"{name}.log").open("w", encoding="utf-8", buffering=1)

    def log(self, line: str) -> None:
        print(f"[{self.name} {self.elapsed():6.1f}s] {line}", flush=True)
        self._log.write(f"[{self.elapsed():7.1f}s] {line}\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out / f".{self.name}.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1, default=_jsonable) + "\n")
        tmp.replace(self.out / f"{self.name}.json")

    def close(self, status: str) -> None:
        self.doc["status"] = status
        self.save()
        self._log.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def run_logged(
    st: Stage, cmd: list[str], log: Path, *, timeout: float, env: dict[str, str] | None = None
) -> int:
    """Run ``cmd`` with its output in ``log``; returns its exit code (124 if over ``timeout``)."""
    st.log("$ " + shlex.join(cmd) + f"  (log: {log.name}, limit {timeout:.0f}s)")
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            return proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------- env
def stage_env(st: Stage, args: argparse.Namespace) -> None:
    import torch

    doc = st.doc
    doc["python"] = platform.python_version()
    doc["platform"] = platform.platform()
    doc["torch"] = torch.__version__
    doc["torch_cuda"] = torch.version.cuda
    doc["cuda_available"] = torch.cuda.is_available()
    doc["packages"] = {n: _version(n) for n in _PROBED}
    doc["nvcc"] = _first_line([_nvcc(), "--version"], last=True)
    doc["nvidia_smi"] = _first_line(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,"
            "clocks.max.sm,temperature.gpu,power.draw",
            "--format=csv,noheader",
        ]
    )
    dev = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        doc["device"] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "total_memory_gib": round(p.total_memory / GIB, 2),
            "multiprocessors": p.multi_processor_count,
            "l2_mib": round(getattr(p, "L2_cache_size", 0) / M, 1),
        }
    else:
        doc["device"] = {"name": "cpu"}
    st.log(f"torch {doc['torch']} (CUDA {doc['torch_cuda']}), device {doc['device']['name']}")
    st.log("packages: " + ", ".join(f"{k} {v}" for k, v in doc["packages"].items()))
    st.save()
    doc["imports"] = import_every_module()
    bad = doc["imports"]["failed"]
    st.log(f"imported {doc['imports']['ok']} modules; {len(bad)} failed")
    for name, err in bad.items():
        st.log(f"  import {name}: {err}")
    st.save()
    from medha_kernels import available_backends

    doc["medha_backends"] = available_backends(dev)
    st.log(f"medha_kernels backends on {dev}: {doc['medha_backends']}")
    doc["ceilings"] = measure_ceilings(dev, small=args.dry_run)
    st.log(
        f"copy {doc['ceilings']['copy_gbps']:.1f} GB/s (read + write), "
        f"bf16 matmul {doc['ceilings']['bf16_mm_tflops']:.4g} TFLOP/s"
    )
    doc["ok"] = not bad
    st.save()


_PROBED = (  # distributions, read from their metadata (nothing is imported)
    "triton",
    "flashinfer-python",
    "apache-tvm-ffi",
    "transformers",
    "tokenizers",
    "safetensors",
    "fastapi",
    "uvicorn",
    "pyzmq",
    "gguf",
    "openai",
    "numpy",
    "pytest",
    "pytest-xdist",
    "pytest-timeout",
    "hypothesis",
    "ruff",
)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvcc() -> str:
    from_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return shutil.which("nvcc") or str(from_home)


def _first_line(cmd: list[str], *, last: bool = False) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.splitlines()
    return (lines[-1] if last else lines[0]) if lines else None


def import_every_module() -> dict[str, Any]:
    """Import every module of the four packages; ``{"ok": n, "failed": {name: error}}``."""
    ok, failed = 0, {}
    for pkg in PACKAGES:
        try:
            root = importlib.import_module(pkg)
        except Exception as exc:
            failed[pkg] = f"{type(exc).__name__}: {exc}"
            continue
        ok += 1
        for info in pkgutil.walk_packages(root.__path__, prefix=pkg + "."):
            if info.name.endswith(".__main__"):  # importing it runs the command line
                continue
            try:
                importlib.import_module(info.name)
                ok += 1
            except BaseException as exc:  # SystemExit too: a module must not exit on import
                failed[info.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return {"ok": ok, "failed": failed}


def measure_ceilings(device: str, *, small: bool) -> dict[str, float]:
    """Median copy GB/s (bytes read + written) and bf16 matmul TFLOP/s on random data."""
    import torch

    cuda = device == "cuda"
    nbytes = (64 * M if small else GIB) if cuda else 32 * M
    n = (1024 if small else 8192) if cuda else 256
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    copy_s = _median_time(lambda: dst.copy_(src), cuda, 20)
    mm_s = _median_time(lambda: torch.mm(a, b), cuda, 10 if not small else 3)
    assert torch.equal(dst, src), "the timed copy did not copy"
    return {
        "copy_gbps": 2 * nbytes / copy_s / 1e9,
        "bf16_mm_tflops": 2 * n**3 / mm_s / 1e12,
        "copy_bytes": nbytes,
        "mm_n": n,
    }


def _median_time(fn: Callable[[], object], cuda: bool, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# ---------------------------------------------------------------------- correctness
DRY_TESTS = ("tests/kernels/test_flashinfer.py", "tests/test_import_direction.py")


def pytest_targets(pytest_args: str | None, dry_run: bool) -> list[str]:
    """The correctness stage's pytest arguments after the fixed options: ``--pytest-args``
    split, then what to collect. Where those arguments name a test path of their own
    (a file or folder under the repository, ``::`` selectors allowed), they choose what
    runs (docs/gpu.md splits the suite this way); otherwise the whole ``tests`` folder,
    or with ``dry_run`` :data:`DRY_TESTS`."""
    extra = shlex.split(pytest_args or "")
    if dry_run:
        return [*extra, *DRY_TESTS]
    named = [a for a in extra if not a.startswith("-") and (ROOT / a.split("::")[0]).exists()]
    return extra if named else [*extra, "tests"]


def stage_correctness(st: Stage, args: argparse.Namespace) -> None:
    outcomes = st.out / ".correctness.outcomes.jsonl"
    outcomes.unlink(missing_ok=True)
    junit = st.out / "correctness.junit.xml"
    cmd = [PY, "-m", "pytest", "-q", "-p", "medha_outcomes", f"--junitxml={junit}"]
    cmd += ["-p", "no:cacheprovider"]
    if not args.dry_run and args.jobs > 1 and _importable("xdist"):
        cmd += ["-n", str(args.jobs), "--dist", "loadfile"]
    if _importable("pytest_timeout"):
        cmd += ["--timeout", "300"]
    cmd += pytest_targets(args.pytest_args, args.dry_run)
    env = {**os.environ, "MEDHA_OUTCOMES": str(outcomes), "PYTHONUNBUFFERED": "1"}
    # the plugin's own folder only: benchmarks/ would shadow packages named like its scripts
    plugin_dir = str(BENCH / "pytest_outcomes")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugin_dir, env.get("PYTHONPATH")]))
    st.doc["command"] = shlex.join(cmd)
    st.save()
    pytest_log = st.out / ".correctness.pytest.log"
    rc = run_logged(st, cmd, pytest_log, timeout=st.left() - 15, env=env)
    log_text = pytest_log.read_text(errors="replace")
    st._log.write(log_text)
    st.doc["pytest_tail"] = "\n".join(log_text.splitlines()[-40:])
    rows = (
        [json.loads(line) for line in outcomes.read_text().splitlines()]
        if outcomes.exists()
        else []
    )
    outcomes.unlink(missing_ok=True)
    pytest_log.unlink(missing_ok=True)
    st.doc |= summarize_outcomes(rows, rc)
    s = st.doc["summary"]
    st.log(
        f"pytest exit {rc}{' (killed at the time limit)' if rc == 124 else ''}: "
        + ", ".join(f"{v} {k}" for k, v in s.items())
    )
    by_reason: dict[str, list[str]] = {}
    for row in st.doc["skipped"]:
        by_reason.setdefault(row["reason"], []).append(row["test"])
    for reason, tests in by_reason.items():
        flag = "CUDA-GATED " if CUDA_GATED.search(reason) else ""
        shown = ", ".join(tests[:3]) + (f" and {len(tests) - 3} more" if len(tests) > 3 else "")
        st.log(f"  {flag}skip x{len(tests)} ({reason}): {shown}")
    for row in st.doc["failed"]:
        st.log(f"  FAIL {row['test']}: {row['reason'].splitlines()[-1] if row['reason'] else ''}")
    st.save()


def summarize_outcomes(rows: list[dict[str, Any]], rc: int) -> dict[str, Any]:
    """Counts, every skip (CUDA-gated ones flagged) and every failure of the outcome lines."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    skipped = [
        {
            "test": r["test"],
            "reason": r.get("reason", ""),
            "cuda_gated": bool(CUDA_GATED.search(r.get("reason", ""))),
        }
        for r in rows
        if r["outcome"] == "skipped"
    ]
    failed = [
        {"test": r["test"], "when": r["when"], "reason": r.get("reason", "")}
        for r in rows
        if r["outcome"] == "failed"
    ]
    slowest = sorted(rows, key=lambda r: -r["seconds"])[:15]
    gated = [s for s in skipped if s["cuda_gated"]]
    return {
        "pytest_exit": rc,
        "timed_out": rc == 124,
        "summary": dict(sorted(counts.items())),
        "skipped": skipped,
        "cuda_gated_skips": len(gated),
        "failed": failed,
        "slowest": [{"test": r["test"], "seconds": r["seconds"]} for r in slowest],
        "ok": rc == 0 and not failed and not gated and bool(rows),
    }


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------- kernels
def _kernels_module():
    """``benchmarks/kernels.py``, loaded by path (benchmarks/ stays off ``sys.path``)."""
    import importlib.util

    name = "medha_benchmarks_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / "kernels.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: its dataclasses look themselves up
        spec.loader.exec_module(module)
    return sys.modules[name]


def _bench(args: argparse.Namespace, backends: str | None = None, iters: int | None = None):
    import torch

    kb = _kernels_module()
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    ns = argparse.Namespace(
        device=device,
        quick=args.dry_run,
        dtype="bfloat16",
        block_size=16,
        iters=3 if args.dry_run else iters or args.iters,
        warmup=1 if args.dry_run else 5,
        mem_gb=None,
        backends=backends,
        ops="merge,decode,prefill",
        figure_chunking=False,
        json=None,
    )
    torch.manual_seed(0)
    bench = kb.Bench(ns)
    bench.quiet = True
    return kb, bench


def kernel_plan(dry: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(op, shape) in order: merge (T, H, D); decode (B, L, Hq, Hkv, D); prefill (c, L, ...)."""
    if dry:
        return [
            *(("merge", (t, 4, 32)) for t in (64, 256)),
            *(("decode", (b, 256, 4, 2, 32)) for b in (1, 4)),
            *(("prefill", (c, 256, 4, 2, 32)) for c in (16, 64)),
        ]
    return [  # chunking's stage covers chunks 32-4096 at 128K-1M keys
        *(("merge", (t, 32, 128)) for t in (16 * K, 64 * K, 256 * K, 4 * K)),
        *(("decode", (b, n, 32, 8, 128)) for b in (1, 16) for n in (4 * K, 32 * K, 128 * K, M)),
        *(("prefill", (c, n, 32, 8, 128)) for n in (4 * K, 32 * K, 128 * K) for c in (512, 2048)),
    ]


def flex_plan(dry: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The shapes flex attention gets (it compiles once per shape: a few, after the rest)."""
    if dry:
        return []
    return [
        *(("decode", (8, n, 32, 8, 128)) for n in (4 * K, 32 * K, 128 * K)),
        *(("prefill", (c, 32 * K, 32, 8, 128)) for c in (128, 512, 2048)),
    ]


def stage_kernels(st: Stage, args: argparse.Namespace) -> None:
    import torch

    kb, bench = _bench(args, args.backends)
    if bench.cuda and not args.backends:  # the torch reference is no contender, and slow
        bench.backends = [b for b in bench.backends if b != "medha/torch"]
    st.doc["device_name"] = kb._device_name(bench.dev)
    st.doc["ceilings"] = bench.ceilings
    st.doc["backends"] = list(bench.backends)
    st.log(f"{st.doc['device_name']}: ceilings {bench.ceilings}; backends {bench.backends}")
    st.save()
    ops = set(args.kernel_ops.split(","))
    with_flex = "flex" in bench.backends
    passes = [([b for b in bench.backends if b != "flex"], kernel_plan(args.dry_run))]
    if with_flex:
        passes.append((["flex"], flex_plan(args.dry_run)))
    for backends, plan in passes:
        bench.backends = backends
        for op, shape in plan:
            if op not in ops:
                continue
            if st.left() < 20:
                bench.skipped.append(f"{op} {shape} {','.join(backends)}: out of time")
                continue
            before, t0 = len(bench.rows), time.monotonic()
            getattr(bench, op)(*shape)
            for r in bench.rows[before:]:
                st.log(kb._fmt(r))
            st.log(f"{op} {shape}: {time.monotonic() - t0:.1f}s (JIT compiles included)")
            if bench.cuda:
                torch.cuda.empty_cache()
            _kernel_doc(st, bench)
    for line in bench.skipped:
        st.log(f"skipped: {line}")
    st.doc["report"] = kernel_report(st.doc.get("rows", []), bench.ceilings, dry=args.dry_run)
    for line in st.doc["report"]["lines"]:
        st.log(line)
    st.save()


def _kernel_doc(st: Stage, bench) -> None:
    from dataclasses import asdict

    st.doc["rows"] = [asdict(r) for r in bench.rows]
    st.doc["skipped"] = list(bench.skipped)
    st.save()


def _own(backend: str) -> bool:
    """Medha's own kernels (the flashinfer adapter is FlashInfer's)."""
    return backend.startswith("medha/") and backend != "medha/flashinfer"


def _shape_num(shape: str, key: str) -> int:
    m = re.search(rf"\b{key}=(\d+)", shape)
    return int(m.group(1)) if m else 0


def kernel_report(
    rows: list[dict[str, Any]], ceilings: dict[str, float], *, dry: bool
) -> dict[str, Any]:
    """Per (op, shape): each backend's fraction of the ceiling that bounds it and its ratio
    to FlashInfer; then the issue's targets on Medha's best own backend."""
    bw, rate = ceilings["copy_gbps"], ceilings.get("bf16_mm_tflops", ceilings["mm_tflops"])
    by_case: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault((r["op"], r["shape"]), {})[r["backend"]] = r
    table, checks = [], []
    for (op, shape), backends in by_case.items():
        fi = backends.get("flashinfer")
        for name, r in backends.items():
            frac = r["tflops"] / rate if op == "prefill" else r["gbps"] / bw
            vs_fi = fi["time_us"] / r["time_us"] if fi else None
            table.append(
                {
                    "op": op,
                    "shape": shape,
                    "backend": name,
                    "fraction": frac,
                    "vs_flashinfer": vs_fi,
                }
            )
        own = {n: r for n, r in backends.items() if _own(n)}
        if not own:
            continue
        best_name = min(own, key=lambda n: own[n]["time_us"])
        best = own[best_name]
        vs_fi = fi["time_us"] / best["time_us"] if fi else None
        if op == "merge" and (dry or _shape_num(shape, "T") >= 16 * K):
            checks.append(_check(op, shape, best_name, "of copy bandwidth", best["gbps"] / bw, 0.9))
            checks.append(_check(op, shape, best_name, "x FlashInfer", vs_fi, 1.0))
        elif op == "decode":
            checks.append(_check(op, shape, best_name, "of copy bandwidth", best["gbps"] / bw, 0.9))
        elif op == "prefill" and (dry or _shape_num(shape, "c") >= 512):
            frac = best["tflops"] / rate
            checks.append(_check(op, shape, best_name, "of bf16 rate", frac, 0.65))
            checks.append(_check(op, shape, best_name, "x FlashInfer", vs_fi, 1.0))
    lines = ["| op | shape | best own backend | measure | value | target | met |"]
    lines.append("|---|---|---|---|---:|---:|---|")
    for c in checks:
        value = "n/a" if c["value"] is None else f"{c['value']:.3g}"
        met = {True: "yes", False: "NO", None: "not measured"}[c["met"]]
        lines.append(
            f"| {c['op']} | {c['shape']} | {c['backend']} | {c['measure']} | {value} | "
            f"{c['target']:g} | {met} |"
        )
    return {"table": table, "checks": checks, "lines": lines}


def _check(
    op: str, shape: str, backend: str, measure: str, value: float | None, target: float
) -> dict[str, Any]:
    met = None if value is None else value >= target
    return {
        "op": op,
        "shape": shape,
        "backend": backend,
        "measure": measure,
        "value": value,
        "target": target,
        "met": met,
    }


# ---------------------------------------------------------------------- chunking
def stage_chunking(st: Stage, args: argparse.Namespace) -> None:
    import torch

    kb, bench = _bench(args, args.backends, iters=min(args.iters, 10))
    if bench.cuda and not args.backends:  # torch's reference is too slow at 1M; flex compiles
        drop = {"medha/torch"} | (set() if args.chunking_flex else {"flex"})
        bench.backends = [b for b in bench.backends if b not in drop]
    st.doc["device_name"] = kb._device_name(bench.dev)
    st.doc["ceilings"] = bench.ceilings
    st.doc["backends"] = bench.backends
    # the longest context first: its chunk-32 overhead is the target
    ctxs = (512, 256) if args.dry_run else (M, 512 * K, 128 * K)
    chunks = (16, 32, 64) if args.dry_run else (32, 64, 128, 256, 512, 1024, 2048, 4096)
    heads = (4, 2, 32) if args.dry_run else (32, 8, 128)
    st.doc["plan"] = {"contexts": ctxs, "chunks": chunks, "heads_q_kv_dim": heads}
    st.log(f"{st.doc['device_name']}: backends {bench.backends}; contexts {ctxs}, chunks {chunks}")
    st.save()
    for ctx in ctxs:
        for c in chunks:
            if st.left() < 20:
                bench.skipped.append(f"prefill c={c} L={ctx}: out of time")
                continue
            before = len(bench.rows)
            bench.prefill(c, ctx, *heads)
            for r in bench.rows[before:]:
                st.log(f"L={ctx} c={c} {r.backend}: {r.time_us / 1e3:.3f} ms, "
                       f"{r.time_us / c:.2f} us/token, {r.tflops:.1f} TFLOP/s")  # fmt: skip
            if bench.cuda:
                torch.cuda.empty_cache()
            _kernel_doc(st, bench)
    st.doc["report"] = chunking_report(st.doc.get("rows", []), small=chunks[0], large=chunks[-2])
    for line in st.doc["report"]["lines"]:
        st.log(line)
    st.save()


def chunking_report(rows: list[dict[str, Any]], *, small: int, large: int) -> dict[str, Any]:
    """Per (context, backend): us per token for every chunk, and the ``small``-chunk
    overhead over the ``large`` chunk (per-token time ratio minus one)."""
    per: dict[tuple[int, str], dict[int, float]] = {}
    for r in rows:
        c, ctx = _shape_num(r["shape"], "c"), _shape_num(r["shape"], "L")
        per.setdefault((ctx, r["backend"]), {})[c] = r["time_us"] / c
    series, lines = [], [f"| context | backend | us/token by chunk | chunk-{small} overhead |"]
    lines.append("|---:|---|---|---:|")
    for (ctx, backend), us in sorted(per.items()):
        over = us[small] / us[large] - 1 if small in us and large in us else None
        series.append({"context": ctx, "backend": backend, "us_per_token": us, "overhead": over})
        cells = ", ".join(f"{c}: {v:.2f}" for c, v in sorted(us.items()))
        shown = "n/a" if over is None else f"{100 * over:.1f}%"
        lines.append(f"| {ctx} | {backend} | {cells} | {shown} |")
    longest = max((s["context"] for s in series), default=0)
    checks = [
        {
            "backend": s["backend"],
            "context": longest,
            "overhead": s["overhead"],
            "target": TARGETS["chunk_overhead"],
            "met": None if s["overhead"] is None else s["overhead"] <= TARGETS["chunk_overhead"],
        }
        for s in series
        if s["context"] == longest and _own(s["backend"])
    ]
    return {"small": small, "large": large, "series": series, "checks": checks, "lines": lines}


# ---------------------------------------------------------------------- runtime
def stage_runtime(st: Stage, args: argparse.Namespace) -> None:
    import torch

    # outside OUT: the device call brings back at most 8 files; the tarball holds these
    work = Path(tempfile.mkdtemp(prefix="medha-gpu-runtime-"))
    st.doc["work_dir"] = str(work)
    cuda = torch.cuda.is_available() and not args.dry_run
    model = args.model or (LLAMA3_8B if cuda else _dry_model(work))
    plan = runtime_plan(args, model, cuda) | {"server_cost_model": args.server_cost_model}
    st.doc["plan"] = plan
    from medha_kernels import available_backends

    # "auto" takes the first of these that runs: flashinfer if importable, else triton
    st.doc["attention_backends"] = available_backends("cuda" if cuda else "cpu")
    st.log(f"model {model}: {json.dumps(plan)}; kernels {st.doc['attention_backends']}")
    st.save()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not cuda:
        env["OMP_NUM_THREADS"] = "1"
    parts = args.runtime_parts.split(",")
    try:
        profile = _runtime_profile(st, args, model, plan, work, env, "profile" in parts)
        trace = work / "trace.jsonl"
        make_mixed_trace(plan, trace)
        servers: dict[str, Any] = {}
        st.doc["servers"] = servers
        for label in ("lars-mp", "fcfs"):
            if label not in parts:
                continue
            if st.left() < plan["server_min_s"]:
                servers[label] = {"error": f"not run: {st.left():.0f}s left of the budget"}
                st.log(servers[label]["error"])
                continue
            servers[label] = serve_and_replay(st, label, model, plan, profile, trace, work, env)
            st.save()
        st.doc["report"] = runtime_report(servers)
        for line in st.doc["report"]["lines"]:
            st.log(line)
    finally:
        with tarfile.open(st.out / "runtime.tar.gz", "w:gz") as tar:
            tar.add(work, arcname="runtime")
        st.save()


def _dry_model(work: Path) -> str:
    """A tiny Llama shape as a ``random:`` model (the same code path as the 8B one)."""
    from medha_runtime.model.tiny import tiny_config

    d = tiny_config().to_hf_dict() | {"vocab_size": 512, "max_position_embeddings": 16384}
    (work / "tiny-random").mkdir(exist_ok=True)
    (work / "tiny-random" / "config.json").write_text(json.dumps(d, indent=1))
    return f"random:{work / 'tiny-random'}"


def runtime_plan(args: argparse.Namespace, model: str, cuda: bool) -> dict[str, Any]:
    """The trace, the profile grid and the KV budget for this device."""
    from medha_runtime.model import load_config

    config = load_config(model)
    if not cuda:
        longs = _ints(args.long_tokens) if args.long_tokens else [2048, 3072]
        return {
            "model": model,
            "device": "cpu",
            "dtype": "float32",
            "long_tokens": longs,
            "long_output": 8,
            "duration_s": args.duration or 8.0,
            "short_qps": args.short_qps or 1.5,
            "short_prompt": [32, 96],
            "short_output": [4, 8],
            "kv_cache_tokens": 16384,
            "max_model_len": 8192,
            "target_batch_time": 0.1,
            "profile_grid": {
                "prefill_q": "1,64,1024",
                "prefill_kv": "0,2048",
                "decode_n": "2,8",
                "decode_kv": "256",
            },
            "profile_repeats": 1,
            "server_min_s": 20,
            "request_timeout_s": 120,
        }
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    big = total > 100 * GIB
    longs = _ints(args.long_tokens) if args.long_tokens else [128 * K, 256 * K if big else 128 * K]
    per_token_kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    weights = 2 * (
        config.num_layers
        * (
            config.hidden_size * (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
            + config.num_q_heads * config.head_dim * config.hidden_size
            + 3 * config.hidden_size * config.intermediate_size
        )
        + 2 * config.vocab_size * config.hidden_size
    )
    # fcfs@0 runs a whole prompt as one step: its activations (gate/up, down, hidden
    # states, q/k/v) are about (3 * ffn + 8 * hidden) bf16 values per token
    act = max(longs) * (3 * config.intermediate_size + 8 * config.hidden_size) * 2
    room = int(0.9 * total) - weights - act - 3 * GIB
    kv_tokens = min(room // per_token_kv, sum(longs) + 64 * K) // 16 * 16
    return {
        "model": model,
        "device": torch.cuda.get_device_name(0),
        "dtype": "bfloat16",
        "long_tokens": longs,
        "long_output": 16,
        "duration_s": args.duration or 60.0,
        "short_qps": args.short_qps or 2.0,
        "short_prompt": [128, 1024],
        "short_output": [32, 128],
        "kv_cache_tokens": kv_tokens,
        "max_model_len": -(-(max(longs) + 64) // 16) * 16,
        "target_batch_time": args.target_batch_time,
        "weights_gib": round(weights / GIB, 2),
        "fcfs_activation_gib": round(act / GIB, 2),
        "profile_grid": {
            "prefill_q": "1,32,128,512,1024,2048,4096",
            "prefill_kv": ",".join(map(str, (0, 16 * K, 64 * K, max(longs) - 4 * K))),
            "decode_n": "2,8,32,64",
            "decode_kv": "1024,4096",
        },
        "profile_repeats": 3,
        "server_min_s": 150,
        "request_timeout_s": 420,
    }


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _runtime_profile(st, args, model, plan, work, env, run: bool) -> Path | None:
    """``medha-runtime profile``: the table the servers price steps with; its fit errors."""
    if args.profile:
        path = Path(args.profile).resolve()
        st.doc["profile"] = {"reused": str(path), **_profile_errors(path)}
        st.log(f"profile reused from {path}")
        return path
    if not run:
        st.doc["profile"] = {"skipped": "not in --runtime-parts; servers calibrate at start"}
        return None
    path = work / "profile.json"
    g = plan["profile_grid"]
    cmd = [PY, "-m", "medha_runtime", "profile", model, "--out", str(path)]
    cmd += ["--dtype", plan["dtype"], "--repeats", str(plan["profile_repeats"])]
    cmd += ["--device", "cpu" if plan["device"] == "cpu" else "cuda"]
    for key in ("prefill_q", "prefill_kv", "decode_n", "decode_kv"):
        cmd += [f"--{key.replace('_', '-')}", g[key]]
    t0 = time.monotonic()
    rc = run_logged(st, cmd, work / "profile.log", timeout=min(st.left() - 60, 300), env=env)
    st.doc["profile"] = {"exit": rc, "seconds": round(time.monotonic() - t0, 1)}
    if rc != 0 or not path.exists():
        st.doc["profile"]["error"] = _tail(work / "profile.log")
        st.log(f"profile failed ({rc}); servers calibrate at start:\n{st.doc['profile']['error']}")
        return None
    shutil.copy(path, st.out / "runtime.profile.json")
    st.doc["profile"] |= _profile_errors(path)
    st.log(f"profile: {json.dumps(st.doc['profile'])}")
    st.save()
    return path


def _profile_errors(path: Path) -> dict[str, Any]:
    meta = json.loads(path.read_text()).get("meta", {})
    return {
        "table_fit": meta.get("table_fit"),
        "roofline": meta.get("roofline"),
        "points": len(meta.get("measurements", [])),
        "torch": meta.get("torch"),
    }


def make_mixed_trace(plan: dict[str, Any], path: Path, seed: int = 0) -> None:
    """Poisson short chats over ``duration_s`` plus the long prompts, evenly spread."""
    import random

    rng = random.Random(seed)
    rows, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(plan["short_qps"])
        if t >= plan["duration_s"]:
            break
        rows.append(
            {
                "id": f"s{i:04d}",
                "arrival_s": round(t, 6),
                "prompt_tokens": rng.randint(*plan["short_prompt"]),
                "output_tokens": rng.randint(*plan["short_output"]),
            }
        )
        i += 1
    gap = plan["duration_s"] / len(plan["long_tokens"])
    for k, n in enumerate(plan["long_tokens"]):
        arrival = round(gap * (k + 0.1), 6)
        rows.append(
            {
                "id": f"L{k}",
                "arrival_s": arrival,
                "prompt_tokens": n,
                "output_tokens": plan["long_output"],
            }
        )
    rows.sort(key=lambda r: r["arrival_s"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def serve_and_replay(st, label, model, plan, profile, trace, work, env) -> dict[str, Any]:
    """Start ``serve`` under ``label``'s policy, replay the trace, stop; metrics and errors."""
    from medha_runtime.server.launch import LaunchError, serve_command, start_server, stop_server

    policy = ["--policy", "lars-mp"] if label == "lars-mp" else ["--policy", "fcfs"]
    if label == "fcfs":
        policy += ["--chunk-size", "0"]
    steps = work / f"{label}.steps.jsonl"
    flags = [*policy, "--dtype", plan["dtype"]]
    flags += ["--device", "cpu" if plan["device"] == "cpu" else "cuda"]
    flags += ["--kv-cache-tokens", str(plan["kv_cache_tokens"])]
    flags += ["--max-model-len", str(plan["max_model_len"]), "--step-log", str(steps)]
    flags += ["--log-level", "warning"]
    spec = plan["server_cost_model"]
    if spec != "default" and ("{profile}" not in spec or profile is not None):
        flags += ["--cost-model", spec.format(profile=profile)]
    if plan.get("target_batch_time"):
        flags += ["--target-batch-time", str(plan["target_batch_time"])]
    out: dict[str, Any] = {"command": shlex.join(serve_command(model, 0, flags))}
    out["cost_model"] = (
        flags[flags.index("--cost-model") + 1] if "--cost-model" in flags else "default"
    )
    st.log("$ " + out["command"] + "  (port 0: a free one)")
    log = work / f"{label}.server.log"
    t0 = time.monotonic()
    try:
        server = start_server(
            model, flags, log=log, env=env, cwd=ROOT, timeout_s=min(240.0, st.left() - 60)
        )
    except LaunchError as exc:
        out["startup_s"] = round(time.monotonic() - t0, 1)
        out["error"] = f"{exc}:\n{_tail(log)}"
        st.log(out["error"])
        return out
    out["startup_s"] = round(time.monotonic() - t0, 1)
    url = server.url
    try:
        result = work / f"{label}.bench.json"
        cmd = [PY, "-m", "medha_runtime", "bench", "--base-url", url, "--dataset-name", "trace"]
        cmd += ["--dataset-path", str(trace), "--no-slo-fields", "--no-progress"]
        cmd += ["--request-timeout", str(plan["request_timeout_s"]), "--long-threshold", "8192"]
        cmd += ["--result-file", str(result)]
        rc = run_logged(st, cmd, work / f"{label}.bench.log", timeout=st.left() - 30, env=env)
        out["bench_exit"] = rc
        if result.exists():
            out |= bench_metrics(result)
        else:
            out["error"] = f"bench wrote no result ({rc}):\n{_tail(work / f'{label}.bench.log')}"
    finally:
        stop_server(server)
    if steps.exists():
        out["cost_model_error"] = step_prediction_error(steps)
    st.log(f"{label}: {json.dumps({k: v for k, v in out.items() if k != 'command'})}")
    return out


def _pct(values: list[float], q: float) -> float | None:
    from medha_sched.sim.metrics import percentile

    return percentile(values, q) if values else None


def bench_metrics(result: Path) -> dict[str, Any]:
    """Short P50/P90 TTFT, TPOT, throughput and lost requests of a ``bench`` result file."""
    reqs = json.loads(result.read_text())["requests"]
    ok = [r for r in reqs if not r.get("error")]
    short = [r["ttft_s"] for r in ok if r["id"].startswith("s") and r.get("ttft_s") is not None]
    longs = [r["ttft_s"] for r in ok if r["id"].startswith("L") and r.get("ttft_s") is not None]
    tpots = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    span = None
    if ok:
        span = max(r["start_s"] + r["e2e_s"] for r in ok) - min(r["start_s"] for r in reqs)
    tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in ok)
    return {
        "requests": len(reqs),
        "lost": len(reqs) - len(ok),
        "lost_ids": [r["id"] for r in reqs if r.get("error")][:20],
        "ttft_p50_short_s": _pct(short, 50),
        "ttft_p90_short_s": _pct(short, 90),
        "ttft_long_s": longs,
        "tpot_p50_s": _pct(tpots, 50),
        "tpot_p90_s": _pct(tpots, 90),
        "tokens_per_s": tokens / span if span else None,
        "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / span if span else None,
    }


def step_prediction_error(path: Path) -> dict[str, Any]:
    """The server's own cost model against its executor, step by step (``predicted_s`` is
    what the scheduler used, whichever model that was): relative errors by step kind."""
    from medha_runtime.step_log import read_step_log

    records = read_step_log(path)
    kinds: dict[str, list[float]] = {"all": [], "with_prefill": [], "decode_only": []}
    for r in records:
        if r.execute_s <= 0 or r.predicted_s <= 0:
            continue
        err = (r.predicted_s - r.execute_s) / r.execute_s
        kinds["all"].append(err)
        kinds["with_prefill" if any(q > 1 for q, _ in r.items) else "decode_only"].append(err)
    out: dict[str, Any] = {"steps": len(records)}
    for kind, errs in kinds.items():
        if errs:
            absolute = [abs(e) for e in errs]
            out[kind] = {
                "steps": len(errs),
                "median_abs": statistics.median(absolute),
                "p90_abs": _pct(absolute, 90),
                "median_signed": statistics.median(errs),
            }
    out["predicted_over_measured_total"] = sum(r.predicted_s for r in records) / max(
        sum(r.execute_s for r in records), 1e-12
    )
    return out


def runtime_report(servers: dict[str, Any]) -> dict[str, Any]:
    lines = [
        "| server | requests | lost | short P50 TTFT | short P90 TTFT | P50 TPOT | P90 TPOT |"
        " tokens/s | cost model median abs error (prefill / decode steps) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def s(v: float | None, scale: float = 1.0, unit: str = " s") -> str:
        return "n/a" if v is None else f"{v * scale:.3g}{unit}"

    for label, m in servers.items():
        if "requests" not in m:
            lines.append(f"| {label} | error: {m.get('error', '?').splitlines()[0]} |")
            continue
        e = m.get("cost_model_error", {})
        pe, de = e.get("with_prefill", {}), e.get("decode_only", {})
        lines.append(
            f"| {label} | {m['requests']} | {m['lost']} | {s(m['ttft_p50_short_s'])} | "
            f"{s(m['ttft_p90_short_s'])} | {s(m['tpot_p50_s'], 1e3, ' ms')} | "
            f"{s(m['tpot_p90_s'], 1e3, ' ms')} | {s(m['tokens_per_s'], 1, '')} | "
            f"{s(pe.get('median_abs'), 100, '%')} / {s(de.get('median_abs'), 100, '%')} |"
        )
    checks = []
    ours, fcfs = servers.get("lars-mp", {}), servers.get("fcfs", {})
    if ours.get("ttft_p90_short_s") and fcfs.get("ttft_p90_short_s"):
        ratio = fcfs["ttft_p90_short_s"] / ours["ttft_p90_short_s"]
        lost = ours["lost"] + fcfs["lost"]
        met = ratio >= TARGETS["ttft_p90_ratio"] and lost == 0
        checks.append({"ttft_p90_ratio": ratio, "lost": lost, "target": 30.0, "met": met})
        lines.append("")
        lines.append(
            f"short P90 TTFT, fcfs@0 / lars-mp: {ratio:.1f}x (target >= 30x), lost requests "
            f"{lost}: {'met' if met else 'NOT met'}"
        )
    return {"lines": lines, "checks": checks}


# ---------------------------------------------------------------------- driver
RUNNERS: dict[str, Callable[[Stage, argparse.Namespace], None]] = {
    "env": stage_env,
    "correctness": stage_correctness,
    "kernels": stage_kernels,
    "chunking": stage_chunking,
    "runtime": stage_runtime,
}


def _budget(args: argparse.Namespace, stage: str) -> float:
    return args.budget_s if args.budget_s is not None else BUDGETS[stage]


def run_in_process(stage: str, args: argparse.Namespace) -> int:
    st = Stage(stage, args.out, _budget(args, stage), args.dry_run)
    st.save()
    try:
        RUNNERS[stage](st, args)
    except BaseException as exc:  # recorded, and the next stage still runs
        st.doc["error"] = traceback.format_exc()
        st.log(f"stage failed: {type(exc).__name__}: {exc}\n{st.doc['error']}")
        st.close("error")
        return 1
    st.close("done")
    return 0


def child_argv(args: argparse.Namespace, stage: str) -> list[str]:
    argv = [PY, str(Path(__file__).resolve()), "--in-process", "--stage", stage]
    argv += ["--out", str(args.out), "--budget-s", str(_budget(args, stage))]
    argv += ["--jobs", str(args.jobs)]
    argv += ["--iters", str(args.iters), "--runtime-parts", args.runtime_parts]
    argv += ["--kernel-ops", args.kernel_ops]
    names = ("pytest_args", "model", "profile", "long_tokens", "duration", "short_qps", "backends")
    names += ("server_cost_model",)
    for flag in names:
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}={value}"]
    if args.target_batch_time is not None:
        argv += ["--target-batch-time", str(args.target_batch_time)]
    argv += ["--dry-run"] * args.dry_run + ["--chunking-flex"] * args.chunking_flex
    return argv


def summary_line(out: Path, stage: str) -> str:
    try:
        doc = json.loads((out / f"{stage}.json").read_text())
    except (OSError, ValueError):
        return f"| {stage} | no JSON written | |"
    status, note = doc.get("status"), ""
    if stage == "env" and "ceilings" in doc:
        c = doc["ceilings"]
        note = (
            f"{doc.get('device', {}).get('name')}; torch {doc.get('torch')}; copy "
            f"{c['copy_gbps']:.0f} GB/s; bf16 {c['bf16_mm_tflops']:.4g} TFLOP/s; "
            f"{len(doc.get('imports', {}).get('failed', {}))} import failures"
        )
    elif stage == "correctness" and "summary" in doc:
        note = f"{doc['summary']}; CUDA-gated skips {doc['cuda_gated_skips']}"
    elif "report" in doc:
        checks = doc["report"].get("checks", [])
        met = sum(1 for c in checks if c.get("met"))
        note = f"{met}/{len(checks)} targets met"
    if doc.get("error"):
        note += " ERROR: " + doc["error"].strip().splitlines()[-1]
    return f"| {stage} | {status} | {note} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for <stage>.json/.log")
    p.add_argument("--stage", action="append", choices=STAGES, default=None)
    p.add_argument("--all", action="store_true", help="every stage, each in its own process")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, a test subset")
    p.add_argument("--budget-s", type=float, default=None, help=f"seconds per stage ({BUDGETS})")
    p.add_argument("--jobs", type=int, default=8, help="pytest-xdist workers (correctness)")
    p.add_argument("--pytest-args", default=None, help="extra pytest arguments (correctness)")
    p.add_argument("--iters", type=int, default=20, help="timed runs per kernel row (median)")
    p.add_argument("--chunking-flex", action="store_true", help="flex attention in chunking")
    p.add_argument("--kernel-ops", default="merge,decode,prefill", help="kernels stage ops")
    p.add_argument("--backends", default=None, help="kernels: comma list, e.g. medha/triton,sdpa")
    p.add_argument("--model", default=None, help=f"runtime model (default {LLAMA3_8B})")
    p.add_argument("--profile", default=None, help="reuse this profile JSON (runtime)")
    p.add_argument("--runtime-parts", default="profile,lars-mp,fcfs")
    p.add_argument(
        "--server-cost-model",
        default="online:prior=table:{profile}",
        help="the servers' --cost-model ({profile}: the profile's path; 'default': none, "
        "the server's own: an online model seeded by a start-up calibration); default: the "
        "online model seeded with the profile. Each step log gives its prediction error",
    )
    p.add_argument("--long-tokens", default=None, help="long prompts, e.g. 131072,262144")
    p.add_argument("--duration", type=float, default=None, help="seconds of short arrivals")
    p.add_argument("--short-qps", type=float, default=None)
    p.add_argument("--target-batch-time", type=float, default=None, help="servers' budget (s)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stages = list(STAGES) if args.all else list(dict.fromkeys(args.stage or []))
    if not stages:
        p.error("name a --stage (repeatable) or --all")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.in_process:
        return run_in_process(stages[0], args)
    codes = {}
    for stage in stages:
        t0 = time.monotonic()
        cmd = child_argv(args, stage)
        print(f"=== {stage}: $ {shlex.join(cmd)}", flush=True)
        try:
            limit = _budget(args, stage) + 60
            codes[stage] = subprocess.run(cmd, cwd=ROOT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            codes[stage] = 124
        print(f"=== {stage}: exit {codes[stage]} after {time.monotonic() - t0:.0f}s", flush=True)
    print("\n| stage | status | summary |\n|---|---|---|")
    for stage in stages:
        print(summary_line(args.out, stage))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
