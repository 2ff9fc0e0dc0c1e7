"""The policy contract: a priority key that is a line in time.

Every shipped policy's key is ``intercept + slope * now`` where intercept and
slope change only when the request makes progress, never with the clock. The
scheduler keeps those two numbers in a kinetic index and evaluates the key at
each decision, so no time-varying value is ever cached in a heap. Smaller
keys are served first; the worst request (largest key) is the preemption
victim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from medha_sched.request import Request


class Policy(ABC):
    """Orders prefills; one small subclass per policy."""

    #: registry name
    name: ClassVar[str]
    #: long prefills yield part of the budget to short ones (multi-prefill batching)
    space_sharing: ClassVar[bool] = False

    @abstractmethod
    def line(self, request: Request) -> tuple[float, float]:
        """``(intercept, slope)`` of the request's key as a function of time."""

    def key(self, request: Request, now: float) -> float:
        """The key at time ``now`` (smaller is served first)."""
        intercept, slope = self.line(request)
        return intercept + slope * now


def slack(request: Request, now: float) -> float:
    """Absolute slack s = a + D - t - w_remaining, in seconds."""
    return request.deadline - now - request.remaining_work


def relative_slack(request: Request, now: float) -> float:
    """LARS relative slack rho = s / w_total."""
    return slack(request, now) / max(request.total_work, 1e-12)
