"""Stream pipelining through the torch.distributed executor: TTFT of one long prompt, side by side.

The multi-node executor (``LLMEngine(..., distributed=DistConfig(...))``: this
process is rank 0 and the driver, the other rank is a local worker joined
through ``env://``, as ``serve --nnodes`` or torchrun run it) on one machine.
One request of ``--context`` tokens (random byte ids) on ``tiny``, greedy,
EOS ignored, ``--new`` output tokens, one torch thread per rank, FCFS with
fixed ``--chunk``-token chunks and a fixed affine cost model. Layouts:

- ``spp1``: one process (the in-process executor);
- ``dist-spp2``: two stages over torch.distributed, stream pipelining on;
- ``dist-spp2-serial``: the same with ``pipeline_depth = 1`` (one batch at a
  time, as this executor ran before it posted steps point to point).

Reports TTFT and TPOT (medians over ``--repeats``, layouts alternating), the
ratios against ``spp1``, whether the greedy tokens match ``spp1``'s, and
the most batches in flight.

    python benchmarks/dist_pipeline.py --context 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics

from spp_pipeline import time_request  # this script's directory

from medha_runtime.dist_config import DistConfig
from medha_runtime.engine import LLMEngine
from medha_sched import AffineCostModel

LAYOUTS = ("spp1", "dist-spp2", "dist-spp2-serial")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(name: str, prompt: list[int], args: argparse.Namespace) -> dict:
    """One request through one layout: TTFT s, TPOT s, tokens, most batches in flight."""
    kw: dict = {}
    if name != "spp1":
        kw = {"spp": 2, "distributed": DistConfig(world_size=2, local_ranks=2,
                                                  master_port=free_port())}  # fmt: skip
    engine = LLMEngine(
        "tiny",
        num_threads=1,
        max_model_len=len(prompt) + args.new + 16,
        kv_cache_tokens=len(prompt) + args.new + 64,
        chunk_size=args.chunk,
        policy="fcfs",
        cost_model=AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9),
        **kw,
    )
    try:
        if name.endswith("serial"):
            engine.pipeline_depth = 1
        ttft, tpot, tokens = time_request(engine, prompt, args.new)
        return {
            "ttft": ttft,
            "tpot": tpot,
            "tokens": tokens,
            "in_flight": engine.stats.max_in_flight,
        }
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(name, None)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 259) for _ in range(args.context)]
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in LAYOUTS}
    for _ in range(args.repeats):
        for name in LAYOUTS:
            runs[name].append(run_one(name, prompt, args))
            r = runs[name][-1]
            print(f"  {name}: TTFT {r['ttft']:.3f} s, TPOT {r['tpot'] * 1e3:.2f} ms", flush=True)
    base = runs["spp1"][0]["tokens"]
    ttft1 = statistics.median(r["ttft"] for r in runs["spp1"])
    tpot1 = statistics.median(r["tpot"] for r in runs["spp1"])
    print(f"{'layout':18s} {'TTFT s':>8s} {'speed-up':>9s} {'TPOT ms':>8s} {'x spp1':>7s}  "
          "in flight  same tokens")  # fmt: skip
    for name, rs in runs.items():
        ttft = statistics.median(r["ttft"] for r in rs)
        tpot = statistics.median(r["tpot"] for r in rs)
        same = all(r["tokens"] == base for r in rs)
        print(
            f"{name:18s} {ttft:8.3f} {ttft1 / ttft:8.2f}x {tpot * 1e3:8.2f} {tpot / tpot1:6.2f}x  "
            f"{max(r['in_flight'] for r in rs):9d}  {'yes' if same else 'NO'}"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
