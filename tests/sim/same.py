"""Two simulations' results compared whole: the check behind every "decisions unchanged"."""

from __future__ import annotations

import dataclasses

from medha_sched.sim.engine import SimResult, Simulator
from medha_sched.sim.runner import RunSpec


def assert_same_results(a: SimResult, b: SimResult) -> None:
    """Requests' records, batches, end time and prefix-cache counters all equal."""
    assert [dataclasses.astuple(r) for r in a.records] == [
        dataclasses.astuple(r) for r in b.records
    ]
    assert a.iterations == b.iterations
    assert a.end_s == b.end_s
    assert (a.prefix_cache_queries, a.prefix_cache_hits) == (
        b.prefix_cache_queries,
        b.prefix_cache_hits,
    )


def simulate(trace, spec: RunSpec, **flags) -> SimResult:
    """``spec``'s simulator (``flags``: :class:`Simulator`'s keywords) run on ``trace``."""
    config, model, cache = spec.build()
    return Simulator(config, model, cache=cache, **flags).run(trace)
