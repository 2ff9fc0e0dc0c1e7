"""When each request is sent: Poisson or gamma arrivals at a rate, all at once, or a trace's times.

Gaps between requests are gamma-distributed with mean ``1 / rate`` and shape
``burstiness`` (vLLM's ``benchmark_serving``): shape 1 is a Poisson process,
smaller shapes are burstier (coefficient of variation ``1 / sqrt(shape)``),
larger ones more regular. The first request goes at time 0. The draw reuses
:func:`medha_sched.sim.workload.arrival_times`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from medha_sched.sim.workload import arrival_times


def arrival_offsets(n: int, *, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` send times in seconds from the start, increasing, the first at 0."""
    if n < 1:
        return []
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 0])
    arrival = "poisson" if burstiness == 1.0 else "gamma"
    times = arrival_times(rng, rate, num_requests=n, arrival=arrival, cv=1 / math.sqrt(burstiness))
    return [float(t - times[0]) for t in times]


def schedule(
    own_times: Sequence[float | None],
    *,
    rate: float | None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """The dataset's own times when all are known and no ``rate`` is given, else drawn ones.

    Without a rate and without times (a generated dataset), every request goes at once.
    """
    n = len(own_times)
    if rate is None and n and all(t is not None for t in own_times):
        return [float(t) for t in own_times]  # type: ignore[arg-type]
    return arrival_offsets(
        n, rate=math.inf if rate is None else rate, burstiness=burstiness, seed=seed
    )
