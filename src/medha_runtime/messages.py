"""The typed messages between the driver and its workers (plain, picklable data).

Driver to worker: :class:`Step` (run one plan), :class:`Ping` (keepalive: the
driver is alive and idle), :class:`Shutdown` (exit cleanly).

Worker to driver: :class:`Ready` (the rank built its runner), :class:`Done`
(the rank finished its share of a step; the sampling rank's carries the
sampled rows), :class:`Failed` (a traceback; the worker stops after sending it).

Every worker answers every :class:`Step` with exactly one :class:`Done` or one
:class:`Failed`, in the order the steps arrived; a worker on pipeline stage 0
answers as soon as its stage is done (its hidden states are posted to stage 1),
which is how the driver learns that a batch cleared stage 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from medha_runtime.plan import StepPlan


@dataclass(frozen=True, slots=True)
class Step:
    """Run ``plan`` (every rank gets the same plan)."""

    plan: StepPlan

    def __reduce__(self) -> tuple[type, tuple]:
        return Step, (self.plan,)  # pickled by the constructor: no per-field state dict


@dataclass(frozen=True, slots=True)
class Ping:
    """A keepalive: nothing to do."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the worker loop; the worker exits with status 0."""


#: what a driver sends
ToWorker = Step | Ping | Shutdown


@dataclass(frozen=True, slots=True)
class Ready:
    """A worker built its runner.

    Attributes:
        rank: its global rank.
        pid: its process id.
        stage: its pipeline stage.
        sampler: whether it samples (exactly one rank does).
    """

    rank: int
    pid: int
    stage: int
    sampler: bool


@dataclass(frozen=True, slots=True)
class Done:
    """A worker finished its share of step ``step_id``.

    Attributes:
        rank: the worker's global rank.
        step_id: the plan's ``step_id``.
        result: the sampled rows (the sampling rank) or None (every other rank).
        compute_s: the wall seconds the rank spent running the step.
        cpu_s: the CPU seconds of the rank's thread in that time, less what
            its thread spent in the waits of ``wait_s`` (the shared-memory
            receives spin before they sleep).
        wait_s: the part of ``compute_s`` a later SPP stage spent waiting for
            the previous stage's activations, or stage 0 (async scheduling)
            for the last stage's sampled tokens (0 without SPP);
            ``compute_s - wait_s`` is the stage's own time.
    """

    rank: int
    step_id: int
    result: list[Any] | None = None
    compute_s: float = 0.0
    cpu_s: float = 0.0
    wait_s: float = 0.0

    def __reduce__(self) -> tuple[type, tuple]:
        args = (self.rank, self.step_id, self.result, self.compute_s, self.cpu_s, self.wait_s)
        return Done, args  # pickled by the constructor: no per-field state dict


@dataclass(frozen=True, slots=True)
class Failed:
    """A worker could not start or run a step; ``error`` holds the traceback."""

    rank: int
    error: str


#: what a worker sends
FromWorker = Ready | Done | Failed
