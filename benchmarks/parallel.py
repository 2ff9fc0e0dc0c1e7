"""Parallelism benchmarks on gloo (CPU, one thread per rank).

1. **SPP prefill speed-up.** One long prompt, chunked, through the toy model of
   ``tests/parallel/toy.py`` (made compute-bound with ``compute_weight``): one
   stage holding every layer vs two stages holding half each, same chunks,
   same per-layer compute. Wall time runs from a barrier to the last stage's
   last chunk; the ideal speed-up with N chunks and S stages is N*S/(N+S-1).
2. **KVP decode latency vs context length** with 1, 2 and 3 KVP groups: each
   group attends over its contiguous shard of the context
   (``medha_kernels.chunked_prefill_attention``) and the partial states are
   merged (``medha_parallel.kvp.KVPCommunicator.merge`` when present, else a
   local all-gather + ``merge_states``). Latency is per decode step and
   attention layer, the slowest rank's, median over steps.
3. **Communication share:** time blocked in send/recv (SPP; this includes
   waiting for the neighbouring stage) or in the merge collectives (KVP; this
   includes waiting for the slowest shard) over the wall time.

    python benchmarks/parallel.py [--quick] [--json PATH]

On a machine with fewer cores than ranks (3 KVP groups on 2 cores) the ranks
share cores, which the numbers then show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the toy model and launch harness live under tests/
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tests.parallel.dist import launch  # noqa: E402
from tests.parallel.toy import ToyConfig, ToyModel, make_tokens  # noqa: E402

from medha_kernels import chunked_prefill_attention, merge_states  # noqa: E402
from medha_parallel import ParallelLayout, ParallelState  # noqa: E402
from medha_parallel.spp import SPPCommunicator, StageRunner  # noqa: E402
from medha_parallel.spp_header import ChunkMeta  # noqa: E402

QUICK = {
    "spp": {"prompt": 1024, "chunk": 128, "n_layers": 8, "compute_weight": 8, "repeats": 2},
    "kvp": {"contexts": [4096, 16384], "steps": 6, "heads": 8, "head_dim": 64},
}
FULL = {
    "spp": {"prompt": 4096, "chunk": 256, "n_layers": 8, "compute_weight": 8, "repeats": 5},
    "kvp": {"contexts": [4096, 16384, 65536], "steps": 16, "heads": 8, "head_dim": 64},
}
BURN_DIM = 512


# -- SPP --------------------------------------------------------------------------------


def _spp_once(state: ParallelState, model: ToyModel, spec: dict, seq_id: int) -> dict:
    comm = SPPCommunicator(state, max_inflight=2)
    stage = model.make_stage(comm.stage, comm.num_stages)
    runner = StageRunner(
        comm,
        lambda meta, x: {"hidden": model.forward_stage(stage, x["hidden"], meta.start_pos)},
        embed=lambda meta, toks: {"hidden": model.embed(toks, meta.start_pos)},
    )
    tokens = make_tokens(spec["prompt"], model.cfg.vocab)
    chunk, n = spec["chunk"], spec["prompt"]
    chunks = [
        (ChunkMeta(seq_id, i, lo, min(chunk, n - lo), is_last=lo + chunk >= n), tokens[lo:][:chunk])
        for i, lo in enumerate(range(0, n, chunk))
    ]
    dist.barrier(group=state.spp_group)
    t0, c0 = time.perf_counter(), time.process_time()
    runner.run(chunks)
    t1, c1 = time.perf_counter(), time.process_time()
    return {
        "t0": t0,
        "t1": t1,
        "cpu_s": c1 - c0,
        "compute_s": sum(t.end - t.start for t in runner.timeline),
        "comm_s": comm.stats.comm_s,
        "bytes_sent": comm.stats.bytes_sent,
    }


def _spp(pipe: ParallelState, single: ParallelState, spec: dict) -> dict:
    """Alternate one-stage runs (rank 0 alone on ``single``'s one-rank pipeline, all
    layers) with two-stage runs on ``pipe``, so both see the same machine load."""
    cfg = ToyConfig(
        n_layers=spec["n_layers"], compute_weight=spec["compute_weight"], burn_dim=BURN_DIM
    )
    model = ToyModel(cfg)
    warm = {**spec, "prompt": 2 * spec["chunk"]}
    first = dist.get_rank() == 0
    if first:
        _spp_once(single, model, warm, seq_id=1000)  # allocator, kernels
    _spp_once(pipe, model, warm, seq_id=1000)  # connections
    out: dict[str, list[dict]] = {"stages_1": [], "stages_2": []}
    for r in range(spec["repeats"]):
        if first:
            out["stages_1"].append(_spp_once(single, model, spec, seq_id=r))
        dist.barrier()
        out["stages_2"].append(_spp_once(pipe, model, spec, seq_id=r))
    return out


# -- KVP --------------------------------------------------------------------------------


def _merge_fn(state: ParallelState, groups: int) -> tuple[str, Any]:
    try:
        from medha_parallel.kvp import KVPCommunicator
    except ImportError:
        KVPCommunicator = None
    if KVPCommunicator is not None:
        comm = KVPCommunicator(state)
        return "medha_parallel.kvp", lambda o, s: comm.merge(o, s, active=groups)
    group = state.kvp_group if groups == state.layout.kvp else state.kvp_prefix.get(groups)

    def local(o: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if groups == 1:
            return o, s
        os_ = o.new_empty((groups * o.shape[0], *o.shape[1:]))
        ss = s.new_empty((groups * s.shape[0], *s.shape[1:]))
        dist.all_gather_into_tensor(os_, o.contiguous(), group=group)
        dist.all_gather_into_tensor(ss, s.contiguous(), group=group)
        os_ = os_.view(groups, *o.shape).transpose(0, 1)
        ss = ss.view(groups, *s.shape).transpose(0, 1)
        return merge_states(os_.contiguous(), ss.contiguous())

    return "local all-gather", local


def _kvp(state: ParallelState, spec: dict, groups: int) -> list[dict] | None:
    """Decode steps over a context split across the first ``groups`` KVP groups."""
    me = state.coords.kvp
    if me >= groups:  # outside the active prefix: sit this one out
        dist.barrier()
        return None
    name, merge = _merge_fn(state, groups)
    group = state.kvp_group if groups == state.layout.kvp else state.kvp_prefix.get(groups)
    h, d, rows = spec["heads"], spec["head_dim"], []
    for ctx in spec["contexts"]:
        g = torch.Generator().manual_seed(ctx)
        k_full, v_full = torch.randn(ctx, h, d, generator=g), torch.randn(ctx, h, d, generator=g)
        lo, hi = ctx * me // groups, ctx * (me + 1) // groups
        k, v = k_full[lo:hi].clone(), v_full[lo:hi].clone()
        compute, comm, total, err = [], [], [], 0.0
        for step in range(spec["steps"] + 2):  # two warm-up steps
            q = torch.randn(1, h, d, generator=torch.Generator().manual_seed(step))
            if groups > 1:
                dist.barrier(group=group)
            t0 = time.perf_counter()
            o, s = chunked_prefill_attention(q, k, v, causal=False, backend="torch")
            t1 = time.perf_counter()
            o, s = merge(o, s)
            t2 = time.perf_counter()
            if step == 0:
                ref, _ = chunked_prefill_attention(q, k_full, v_full, causal=False, backend="torch")
                err = (o - ref).abs().max().item()
            elif step >= 2:
                compute.append(t1 - t0)
                comm.append(t2 - t1)
                total.append(t2 - t0)
        rows.append(
            {
                "ctx": ctx,
                "merge": name,
                "compute": compute,
                "comm": comm,
                "total": total,
                "err": err,
            }
        )
    dist.barrier()
    return rows


# -- launches -----------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, init: str, spec: dict) -> dict:
    # gloo's all_gather_into_tensor is deprecated in favour of a name it lacks here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

    def state(**degrees: int) -> ParallelState:
        return ParallelState.initialize(  # gloo on any machine: these are CPU numbers
            ParallelLayout(**degrees),
            backend="gloo",
            init_method=init,
            rank=rank,
            world_size=world_size,
            timeout_s=120,
        )

    kvp_state = state(kvp=world_size)  # also gives every rank a one-stage pipeline
    out: dict = {}
    if world_size == 2:
        out["spp"] = _spp(state(spp=2), kvp_state, spec["spp"])
        out["kvp1"] = _kvp(kvp_state, spec["kvp"], 1)
    out[f"kvp{world_size}"] = _kvp(kvp_state, spec["kvp"], world_size)
    return out


def _spp_summary(per_rank: list[list[dict]]) -> dict:
    walls, comm_fracs = [], []
    for r in range(len(per_rank[0])):
        runs = [ranks[r] for ranks in per_rank]
        wall = max(x["t1"] for x in runs) - min(x["t0"] for x in runs)
        walls.append(wall)
        comm_fracs.append(max(x["comm_s"] for x in runs) / wall)
    best = min(range(len(walls)), key=walls.__getitem__)
    runs = [ranks[best] for ranks in per_rank]
    return {
        "wall_s": walls[best],
        "walls_s": walls,
        "compute_s_per_rank": [x["compute_s"] for x in runs],
        "comm_s_per_rank": [x["comm_s"] for x in runs],
        "cpu_s_per_rank": [x["cpu_s"] for x in runs],
        "comm_fraction": comm_fracs[best],
        "bytes_sent": sum(x["bytes_sent"] for x in runs),
    }


def run(quick: bool, *, prompt: int | None = None, chunk: int | None = None) -> dict:
    spec = QUICK if quick else FULL
    spp_over = {k: v for k, v in (("prompt", prompt), ("chunk", chunk)) if v is not None}
    spec = {**spec, "spp": {**spec["spp"], **spp_over}}
    results: dict[int, list[dict]] = {}
    launch_s = {}
    for ws in (2, 3):
        t = time.perf_counter()
        results[ws] = launch(_rank_main, ws, spec, timeout=600)
        launch_s[ws] = time.perf_counter() - t
    s = spec["spp"]
    one = _spp_summary([results[2][0]["spp"]["stages_1"]])
    two = _spp_summary([r["spp"]["stages_2"] for r in results[2]])
    n_chunks = -(-s["prompt"] // s["chunk"])
    spp = {
        **s,
        "chunks": n_chunks,
        "burn_dim": BURN_DIM,
        "stages_1": one,
        "stages_2": two,
        "speedup": one["wall_s"] / two["wall_s"],
        "speedup_median": statistics.median(one["walls_s"]) / statistics.median(two["walls_s"]),
        "ideal_speedup": n_chunks * 2 / (n_chunks + 1),
    }
    kvp = []
    for groups in (1, 2, 3):
        runs = results[max(groups, 2)]
        per_rank = [r[f"kvp{groups}"] for r in runs if r.get(f"kvp{groups}") is not None]
        for i, ctx in enumerate(spec["kvp"]["contexts"]):
            rows = [pr[i] for pr in per_rank]
            steps = range(len(rows[0]["total"]))
            total = [max(r["total"][j] for r in rows) for j in steps]
            comm = [max(r["comm"][j] for r in rows) for j in steps]
            compute = [max(r["compute"][j] for r in rows) for j in steps]
            kvp.append(
                {
                    "groups": groups,
                    "ctx": ctx,
                    "merge": rows[0]["merge"],
                    "latency_ms": 1e3 * statistics.median(total),
                    "compute_ms": 1e3 * statistics.median(compute),
                    "comm_ms": 1e3 * statistics.median(comm),
                    "comm_fraction": sum(comm) / sum(total),
                    "max_abs_err": max(r["err"] for r in rows),
                }
            )
    base = {row["ctx"]: row["latency_ms"] for row in kvp if row["groups"] == 1}
    for row in kvp:
        row["speedup_vs_1"] = base[row["ctx"]] / row["latency_ms"]
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "quick": quick,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg_1min_after": load,
        "threads_per_rank": 1,
        "launch_s": launch_s,
        "spp": spp,
        "kvp": kvp,
    }


def print_tables(res: dict) -> None:
    spp = res["spp"]
    print(
        f"## SPP chunked prefill: {spp['prompt']} tokens in {spp['chunks']} chunks of "
        f"{spp['chunk']}, {spp['n_layers']} layers (compute_weight={spp['compute_weight']}, "
        f"burn_dim={spp['burn_dim']}), best of {spp['repeats']}\n"
    )
    print("| stages | layers/stage | wall (s) | comm share | speed-up | ideal |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, key in ((1, "stages_1"), (2, "stages_2")):
        row = spp[key]
        speed = 1.0 if n == 1 else spp["speedup"]
        ideal = 1.0 if n == 1 else spp["ideal_speedup"]
        print(
            f"| {n} | {spp['n_layers'] // n} | {row['wall_s']:.3f} | "
            f"{row['comm_fraction']:.1%} | {speed:.2f}x | {ideal:.2f}x |"
        )
    walls = ", ".join(
        f"{n} stage(s) [{', '.join(f'{w:.3f}' for w in spp[k]['walls_s'])}]"
        for n, k in ((1, "stages_1"), (2, "stages_2"))
    )
    print(f"\nWall time per repeat (s, runs alternate): {walls}.")
    print("\n## KVP decode attention latency (1 query, slowest rank, median)\n")
    print("| groups | context | latency (ms) | compute (ms) | merge (ms) | comm share | vs 1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in res["kvp"]:
        print(
            f"| {row['groups']} | {row['ctx']} | {row['latency_ms']:.2f} | "
            f"{row['compute_ms']:.2f} | {row['comm_ms']:.2f} | {row['comm_fraction']:.1%} | "
            f"{row['speedup_vs_1']:.2f}x |"
        )
    merge = res["kvp"][0]["merge"]
    print(
        f"\nKVP merge: {merge}; {res['cpus']} CPUs, 1 thread per rank, torch {res['torch']}; "
        f"SPP median-of-repeats speed-up {spp['speedup_median']:.2f}x; "
        f"1-min load average after the run {res['load_avg_1min_after']}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--prompt", type=int, default=None, help="SPP prompt tokens")
    parser.add_argument("--chunk", type=int, default=None, help="SPP chunk tokens")
    args = parser.parse_args(argv)
    res = run(args.quick, prompt=args.prompt, chunk=args.chunk)
    print_tables(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
