"""The non-driver ranks of a :class:`~medha_runtime.dist_executor.DistributedExecutor`.

- :func:`worker_main`: one rank. It joins the world (:func:`join_world`),
  receives the :class:`~medha_runtime.runner.RunnerSpec` from the driver,
  builds its :class:`~medha_runtime.runner.ModelRunner`, reports ready, then
  serves the one worker loop (:func:`medha_runtime.worker.serve`) over the
  control group (:class:`~medha_runtime.transport.DistTransport`: the sampling
  rank sends its sampled rows back to rank 0) until a shutdown message (exit
  status 0) or until the driver or a peer is gone (status 1, the reason on
  stderr).
- :func:`start_workers`: worker processes for some ranks on this node
  (forkserver start method, daemonic).
- :func:`run_node`: a node other than the driver's (``--node-rank R > 0``):
  start its ranks, stay in the foreground until they end; 0 if every rank
  was shut down by the driver, 1 otherwise (the driver died, a rank failed,
  or SIGINT/SIGTERM stopped the node).
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import wait
from typing import Any

from medha_runtime.dist_config import (
    DistConfig,
    JoinRefused,
    build_rank,
    join_world,
    leave_world,
    set_threads,
)
from medha_runtime.executor import join_or_kill
from medha_runtime.transport import DistTransport
from medha_runtime.worker import serve

#: how long the other ranks of a node may take to end once one of them failed
GRACE_S = 10.0


def worker_main(config: DistConfig, *, rank: int, local_rank: int, local_world: int) -> int:
    """Run rank ``rank`` until the driver shuts it down; returns the exit status."""
    import torch.distributed as dist

    try:
        try:
            control = join_world(config, rank=rank, local_rank=local_rank)
        except JoinRefused as exc:
            _say(rank, str(exc))
            return 1
        box: list[Any] = [None]
        # start-up (every rank builds its model) on the default group: the start bound
        dist.broadcast_object_list(box, src=0)
        spec = box[0]
        set_threads(spec, local_world)
        _, runner, error = build_rank(spec)
        info = {
            "rank": rank,
            "sampler": runner is not None and runner.is_sampler,
            "stage": None if runner is None else runner.stage,
            "error": error,
        }
        dist.gather_object(info, None, dst=0)
        if runner is None:
            _say(rank, f"failed to start:\n{error}")
            return 1
        transport = DistTransport(
            control, rank=rank, replies=runner.is_sampler and rank != 0, times=spec.spp > 1
        )
        code = serve(runner, transport, rank=rank)
        if code:
            _say(rank, "stopping: the driver or a peer rank is gone, or a step failed (see above)")
        return code
    except Exception as exc:
        _say(rank, f"stopping: the driver or a peer rank is gone ({type(exc).__name__}: {exc})")
        return 1
    finally:
        leave_world()


def _say(rank: int, text: str) -> None:
    print(f"medha-runtime worker rank {rank}: {text}", file=sys.stderr, flush=True)


def _process_main(config: DistConfig, rank: int, local_rank: int, local_world: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node (or the driver) decides
    sys.exit(worker_main(config, rank=rank, local_rank=local_rank, local_world=local_world))


def start_workers(
    config: DistConfig, ranks: range, *, node_first_rank: int, local_world: int
) -> list[Any]:
    """Start one daemonic worker process per rank of ``ranks``; this node runs
    ``local_world`` ranks from ``node_first_rank`` on (local rank = rank - that)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    first = node_first_rank
    procs = []
    for rank in ranks:
        p = ctx.Process(
            target=_process_main,
            args=(config, rank, rank - first, local_world),
            name=f"medha-worker-{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    return procs


def run_node(config: DistConfig, *, node_rank: int, ranks_per_node: int) -> int:
    """Run node ``node_rank``'s ranks in the foreground; returns the exit status."""
    first = node_rank * ranks_per_node
    ranks = range(first, first + ranks_per_node)
    print(
        f"medha-runtime serve: node {node_rank}: ranks {ranks.start}..{ranks.stop - 1} of "
        f"{config.world_size}, rendezvous at {config.master_addr}:{config.master_port} "
        f"(waiting at most {config.start_timeout_s:.0f} s for every node)",
        file=sys.stderr,
        flush=True,
    )
    stop: list[int] = []

    def _on_signal(signum: int, frame: Any) -> None:
        stop.append(signum)

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs = start_workers(config, ranks, node_first_rank=first, local_world=ranks_per_node)
    try:
        return _watch(procs, ranks, stop)
    finally:
        join_or_kill(procs, 0.0)
        for s, handler in old.items():
            signal.signal(s, handler)


def _watch(procs: list[Any], ranks: range, stop: list[int]) -> int:
    while True:
        if stop:
            print(f"medha-runtime serve: stopped by signal {stop[0]}", file=sys.stderr)
            return 1
        wait([p.sentinel for p in procs], timeout=0.5)
        codes = {r: p.exitcode for r, p in zip(ranks, procs, strict=True)}
        bad = {r: c for r, c in codes.items() if c not in (None, 0)}
        if bad:
            join_or_kill(procs, GRACE_S)
            rank, code = next(iter(bad.items()))
            print(
                f"medha-runtime serve: rank {rank} exited with code {code} (the driver or a "
                "peer is gone, or the rank failed: see above); stopping this node",
                file=sys.stderr,
            )
            return 1
        if all(c == 0 for c in codes.values()):
            print("medha-runtime serve: the driver shut down; exiting", file=sys.stderr)
            return 0
