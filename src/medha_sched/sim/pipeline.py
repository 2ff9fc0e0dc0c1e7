"""The executor model: a FIFO pipeline of SPP stages.

A replica with stream-pipeline depth ``s`` splits the layers over ``s``
stages. A batch whose predicted latency (through every stage) is ``P``
keeps each stage busy for ``P / s``. Batches go through the stages in the
order they were issued: a batch enters stage ``k`` when it has left stage
``k - 1`` and stage ``k`` is free. A new batch may be issued as soon as
stage 0 is free, so with ``s > 1`` up to ``s`` batches are in flight.
"""

from __future__ import annotations


class Pipeline:
    """When each stage becomes free; batches are pushed in issue order.

    Args:
        num_stages: the SPP depth (>= 1).
    """

    __slots__ = ("_free", "num_stages")

    def __init__(self, num_stages: int) -> None:
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        self.num_stages = num_stages
        self._free = [0.0] * num_stages

    def stage0_free(self, now: float) -> bool:
        """True when a new batch may be issued at ``now``."""
        return self._free[0] <= now

    @property
    def stage0_free_at(self) -> float:
        return self._free[0]

    @property
    def free(self) -> list[float]:
        """When each stage becomes free (a copy)."""
        return list(self._free)

    @free.setter
    def free(self, times: list[float]) -> None:
        if len(times) != self.num_stages:
            raise ValueError(f"expected {self.num_stages} stage times, got {len(times)}")
        self._free = list(times)

    def peek(self, now: float, stage_time: float) -> float:
        """When a batch issued at ``now`` would leave the last stage (nothing changes)."""
        free = self._free
        t = (now if now > free[0] else free[0]) + stage_time
        for k in range(1, self.num_stages):
            f = free[k]
            t = (t if t > f else f) + stage_time
        return t

    def push(self, now: float, stage_time: float) -> tuple[float, float]:
        """Issue a batch at ``now``; returns (time it leaves stage 0, time it leaves the last)."""
        return push_times(self._free, now, stage_time)


def push_times(free: list[float], now: float, stage_time: float) -> tuple[float, float]:
    """:meth:`Pipeline.push` on a list of stage free times (updated in place):
    (time the batch leaves stage 0, time it leaves the last stage)."""
    t = (now if now > free[0] else free[0]) + stage_time
    free[0] = first = t
    for k in range(1, len(free)):
        f = free[k]
        t = (t if t > f else f) + stage_time
        free[k] = t
    return first, t
