"""TokenBroadcast latency: the sampling rank's token ids to the other ranks.

Async scheduling on worker processes (spp = 1) adds one
:class:`medha_parallel.TokenBroadcast` per step: after sampling, rank 0 sends
the step's ``--ids`` token ids to every rank, through shared memory where
every rank is on this host (the default) or one gloo ``int64`` tensor.
This times ``--calls`` of them on ``--ranks`` forkserver processes (``file://``
rendezvous, one torch thread each: ``tests/parallel/dist.py``'s ``launch``)
after 200 warm-up calls, for each of ``--transports`` in turn, and prints each
rank's median and mean microseconds per call.

    python benchmarks/token_broadcast.py
    python benchmarks/token_broadcast.py --ids 256 --ranks 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launch harness: tests/
from tests.parallel.dist import launch


def _rank(rank: int, ranks: int, init: str, ids: int, calls: int, shm: bool) -> tuple[float, float]:
    """Rank ``rank``'s (median, mean) seconds per broadcast."""
    from medha_parallel import ParallelLayout, ParallelState, TokenBroadcast

    torch.set_num_threads(1)
    state = ParallelState.initialize(
        ParallelLayout(tp=ranks), backend="gloo", init_method=init, rank=rank, world_size=ranks
    )
    tokens = TokenBroadcast(state, src=0, shared_memory=shm)
    assert tokens.uses_shared_memory == shm
    sent = list(range(ids)) if rank == 0 else None
    for _ in range(200):
        tokens.broadcast(sent, ids)
    seconds = []
    for _ in range(calls):
        t = time.perf_counter()
        got = tokens.broadcast(sent, ids)
        seconds.append(time.perf_counter() - t)
    assert got == list(range(ids))
    state.destroy()
    return statistics.median(seconds), statistics.fmean(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--transports", nargs="+", choices=("shm", "gloo"), default=["shm", "gloo"])
    args = ap.parse_args()
    for transport in args.transports:
        _measure(args, transport)


def _measure(args: argparse.Namespace, transport: str) -> None:
    shm = transport == "shm"
    results = launch(_rank, args.ranks, args.ids, args.calls, shm, timeout=600.0)
    print(
        f"TokenBroadcast ({transport}), {args.ids} ids, {args.ranks} ranks, {args.calls} calls, "
        f"load average {os.getloadavg()[0]:.1f}:"
    )
    for rank, (med, mean) in enumerate(results):
        print(f"  rank {rank}: median {1e6 * med:.1f} us, mean {1e6 * mean:.1f} us per call")


if __name__ == "__main__":
    main()
