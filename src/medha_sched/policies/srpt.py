"""Shortest remaining processing time."""

from __future__ import annotations

from medha_sched.policies.base import Policy
from medha_sched.request import Request


class SRPTPolicy(Policy):
    """Key = predicted remaining prefill time."""

    name = "srpt"

    def line(self, request: Request) -> tuple[float, float]:
        return request.remaining_work, 0.0
