"""medha_sched.sim: a discrete-event simulator of one Medha replica.

It drives the real :class:`~medha_sched.Scheduler` with any cost model and
replaces the executor by the model's predicted batch time, pushed through a
FIFO pipeline of SPP stages. ``import medha_sched`` does not import it; it
needs numpy (workloads) and, for plots only, matplotlib.

>>> from medha_sched import AffineCostModel, SchedulerConfig
>>> from medha_sched.sim import TraceRequest, simulate
>>> trace = [TraceRequest("a", 0.0, 100, 3), TraceRequest("b", 0.01, 50, 1)]
>>> result = simulate(
...     trace,
...     SchedulerConfig(policy="lars", target_batch_time=0.05),
...     AffineCostModel(base=0.01, per_token=1e-4, per_attn=0.0),
... )
>>> [round(r.ttft_s, 3) for r in result.records]
[0.02, 0.025]

Modules: :mod:`.trace` (JSONL traces), :mod:`.workload` (arrivals and
length distributions), :mod:`.events`, :mod:`.pipeline` and :mod:`.engine`
(the event loop), :mod:`.metrics` (per-request and per-iteration records,
summary), :mod:`.runner` (one run from CLI-style options, outputs on disk),
:mod:`.compare` (sweeps), :mod:`.plot` and :mod:`.cli` (``medha-sim``).

The names below load on first use, so that ``medha-sim --help`` and the
command line's checks for missing extras need no numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SimResult": "medha_sched.sim.engine",
    "SimulationError": "medha_sched.sim.engine",
    "Simulator": "medha_sched.sim.engine",
    "simulate": "medha_sched.sim.engine",
    "IterationRecord": "medha_sched.sim.metrics",
    "RequestRecord": "medha_sched.sim.metrics",
    "summarize": "medha_sched.sim.metrics",
    "TraceError": "medha_sched.sim.trace",
    "TraceRequest": "medha_sched.sim.trace",
    "read_trace": "medha_sched.sim.trace",
    "write_trace": "medha_sched.sim.trace",
    "WorkloadSpec": "medha_sched.sim.workload",
    "generate": "medha_sched.sim.workload",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'medha_sched.sim' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
