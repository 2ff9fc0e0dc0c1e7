"""Time ``medha-runtime serve smollm2`` from launch to its first chat answer.

Reports, on this machine:

- load: ``load_model("smollm2")`` alone (GGUF read, dequantized to fp32), in a
  fresh process, and that process's peak RSS (``ru_maxrss``);
- start: from launching ``serve smollm2`` to ``/health`` answering 200 (model
  load in the HTTP and engine processes, KV cache, the start-up calibration);
- peak RSS of the engine process (``VmHWM``) once it serves;
- the first chat request's latency and its answer (greedy, 24 tokens at most).

Usage: ``python benchmarks/serve_smollm2.py [--port 8765] [--cost-model SPEC]``
(fetches smollm2 into the Medha cache first if needed; ``--cost-model`` is
passed to serve, which then skips its start-up calibration).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LOAD = """
import json, resource, time
t = time.perf_counter()
from medha_runtime.model import load_model
model, config = load_model("smollm2", dtype="float32")
print(json.dumps({"load_s": time.perf_counter() - t,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--cost-model", default=None, help="passed to serve (skips the start-up calibration)"
    )
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "medha_runtime", "download", "smollm2"], check=True)
    load = json.loads(subprocess.run([sys.executable, "-c", LOAD], capture_output=True,
                                     text=True, check=True).stdout)  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "smollm2", "--port", str(args.port)]
    if args.cost_model:
        cmd += ["--cost-model", args.cost_model]
    proc = subprocess.Popen([*cmd, "--log-level", "warning"], start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with code {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        start_s = time.perf_counter() - t0
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 24,
        }
        t1 = time.perf_counter()
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
        first_s = time.perf_counter() - t1
        engines = _children(proc.pid)
        rss = {pid: _vm_hwm_mb(pid) for pid in [proc.pid, *engines]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    print(f"load_model('smollm2') fp32:      {load['load_s']:.1f} s, "
          f"peak RSS {load['peak_rss_mb']:.0f} MB")  # fmt: skip
    print(f"serve start to /health 200:     {start_s:.1f} s")
    print("peak RSS (VmHWM) per process:   "
          + ", ".join(f"pid {p}: {v:.0f} MB" for p, v in rss.items()))  # fmt: skip
    print(f"first chat answer:              {first_s:.2f} s")
    print(f"answer: {reply['choices'][0]['message']['content']!r}")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
