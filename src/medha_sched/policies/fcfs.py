"""First come, first served."""

from __future__ import annotations

from medha_sched.policies.base import Policy
from medha_sched.request import Request


class FCFSPolicy(Policy):
    """Key = arrival time."""

    name = "fcfs"

    def line(self, request: Request) -> tuple[float, float]:
        return request.arrival_time, 0.0
