"""Run a function on N gloo ranks: forkserver processes, ``file://`` init, one thread each.

``fn(rank, world_size, init_method, *args)`` must be a module-level function.
Its return value (picklable) comes back in a list indexed by rank. A rank that
raises fails the launch with its traceback; a launch that outlives
``timeout`` is killed and fails, so nothing hangs.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world_size: int, workdir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init = f"file://{workdir}/init"
    result = fn(rank, world_size, init, *args)
    Path(workdir, f"result{rank}.pkl").write_bytes(pickle.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; return each rank's result."""
    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, workdir, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"distributed launch of {fn.__name__} exceeded {timeout}s")
        return [
            pickle.loads(Path(workdir, f"result{r}.pkl").read_bytes()) for r in range(world_size)
        ]
