"""Earliest deadline first."""

from __future__ import annotations

from medha_sched.policies.base import Policy
from medha_sched.request import Request


class EDFPolicy(Policy):
    """Key = absolute TTFT deadline a + D."""

    name = "edf"

    def line(self, request: Request) -> tuple[float, float]:
        return request.deadline, 0.0
