"""Least remaining slack."""

from __future__ import annotations

from medha_sched.policies.base import Policy
from medha_sched.request import Request


class LRSPolicy(Policy):
    """Key = absolute slack s = a + D - t - w_remaining."""

    name = "lrs"

    def line(self, request: Request) -> tuple[float, float]:
        return request.deadline - request.remaining_work, -1.0
