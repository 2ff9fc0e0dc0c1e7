"""The simulator's events, one class per event.

An event happens at ``time`` and, when handled, tells the simulator what
happened; the simulator reacts (calls the scheduler, pushes new events).
Events at the same time are handled in ``rank`` order, then in the order
they were pushed: pipeline progress first, then arrivals, and the schedule
wake-up last, so one decision sees everything that happened at its instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # the engine imports this module; only type hints go back
    from medha_sched.sim.engine import Simulator


class Event:
    """Something that happens at ``time`` (seconds)."""

    __slots__ = ("time",)
    #: order among events at the same time (smaller first)
    rank: ClassVar[int]

    def __init__(self, time: float) -> None:
        self.time = time

    def handle(self, sim: Simulator) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(time={self.time!r})"


class StageEnd(Event):
    """A batch leaves SPP stage 0: its prefills' next chunks may be issued."""

    __slots__ = ("batch_id",)
    rank = 0

    def __init__(self, time: float, batch_id: int) -> None:
        self.time = time
        self.batch_id = batch_id

    def handle(self, sim: Simulator) -> None:
        sim.on_stage_end(self.batch_id)


class BatchEnd(Event):
    """A batch leaves the last stage: its sampled tokens exist."""

    __slots__ = ("batch_id",)
    rank = 1

    def __init__(self, time: float, batch_id: int) -> None:
        self.time = time
        self.batch_id = batch_id

    def handle(self, sim: Simulator) -> None:
        sim.on_batch_end(self.batch_id)


class Arrival(Event):
    """A request arrives (``index`` into the trace)."""

    __slots__ = ("index",)
    rank = 2

    def __init__(self, time: float, index: int) -> None:
        self.time = time
        self.index = index

    def handle(self, sim: Simulator) -> None:
        sim.on_arrival(self.index)


class ScheduleWakeup(Event):
    """Stage 0 is free and something changed: ask the scheduler for a batch."""

    __slots__ = ()
    rank = 3

    def handle(self, sim: Simulator) -> None:
        sim.on_wakeup()
