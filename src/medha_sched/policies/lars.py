"""Length-aware relative slack (LARS), the paper's policy (section 4.1)."""

from __future__ import annotations

from medha_sched.policies.base import Policy
from medha_sched.request import Request


class LARSPolicy(Policy):
    """Key = rho = (a + D - t - w_remaining) / w_total.

    A long request with a comfortable absolute slack still has little slack
    per unit of work, so it is not starved the way EDF starves it.
    """

    name = "lars"

    def line(self, request: Request) -> tuple[float, float]:
        w_total = request.total_work
        if w_total < 1e-12:  # max(w_total, 1e-12): w_total itself when equal (or NaN)
            w_total = 1e-12
        return (request.deadline - request.remaining_work) / w_total, -1.0 / w_total


class LARSMultiPrefillPolicy(LARSPolicy):
    """LARS with space sharing: a long prefill yields ``T * clamp(rho, 0, rho_max)``."""

    name = "lars-mp"
    space_sharing = True
