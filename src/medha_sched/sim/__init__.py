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
"""

from medha_sched.sim.engine import SimResult as SimResult
from medha_sched.sim.engine import SimulationError as SimulationError
from medha_sched.sim.engine import Simulator as Simulator
from medha_sched.sim.engine import simulate as simulate
from medha_sched.sim.metrics import IterationRecord as IterationRecord
from medha_sched.sim.metrics import RequestRecord as RequestRecord
from medha_sched.sim.metrics import summarize as summarize
from medha_sched.sim.trace import TraceError as TraceError
from medha_sched.sim.trace import TraceRequest as TraceRequest
from medha_sched.sim.trace import read_trace as read_trace
from medha_sched.sim.trace import write_trace as write_trace
from medha_sched.sim.workload import WorkloadSpec as WorkloadSpec
from medha_sched.sim.workload import generate as generate
