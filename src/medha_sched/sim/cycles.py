"""A lane cycle's turns in the pipeline: when each decode-only batch of lanes
taking turns (``Scheduler.plan_lane_cycle``) is issued and ends.

A turn of a lane is issued when the lane's last batch has ended and stage 0
is free, as going one batch at a time would; the cycle stops at a lane out of
planned turns, before a turn that would not come strictly before ``horizon``,
or one that would find another lane ready too (``schedule`` would merge them).
"""

from __future__ import annotations

from collections.abc import Sequence

from medha_sched.sim.pipeline import push_times

Turns = tuple[list[float], list[float], list[float], bool]
"""(issue times, predicted times, end times, whether a lane ran out of turns)."""


def cycle_turns(
    times: Sequence[Sequence[float]],
    ready: list[float],
    free: list[float],
    horizon: float,
) -> Turns:
    """The cycle's turns: lane ``i % k`` takes issue ``i``; ``times[x]`` are
    lane ``x``'s planned turns, ``ready[x]`` when it is ready (updated), ``free``
    the stages' free times (updated, ``Pipeline.push`` on a copy)."""
    if len(times) == 2 and len(free) == 2:
        return two_lane_turns(times, ready, free, horizon)
    return any_turns(times, ready, free, horizon)


def any_turns(
    times: Sequence[Sequence[float]],
    ready: list[float],
    free: list[float],
    horizon: float,
) -> Turns:
    """:func:`cycle_turns` for any number of lanes and stages, turn by turn."""
    k, spp = len(times), len(free)
    turns = [0] * k
    starts: list[float] = []
    predicted: list[float] = []
    ends: list[float] = []
    x = 0
    while True:
        tx = times[x]
        j = turns[x]
        if j == len(tx):
            break
        s = ready[x]
        if free[0] > s:
            s = free[0]
        if not s < horizon:
            break
        if any(ready[y] <= s for y in range(k) if y != x):
            break
        p = tx[j]
        _, t = push_times(free, s, p / spp)  # s >= free[0]
        ready[x] = t
        turns[x] = j + 1
        starts.append(s)
        predicted.append(p)
        ends.append(t)
        x = x + 1 if x + 1 < k else 0
    return starts, predicted, ends, len(times[x]) == turns[x]


def two_lane_turns(
    times: Sequence[Sequence[float]],
    ready: list[float],
    free: list[float],
    horizon: float,
) -> Turns:
    """:func:`cycle_turns` for two lanes and two stages: a copy of :func:`any_turns`' loop,
    one round (lane 0, then lane 1) a pass, ``push_times`` written out (the
    same floats; twin-tested in ``tests/sim/test_cycle_turns.py``)."""
    t0s, t1s = times
    n0, n1 = len(t0s), len(t1s)
    r0, r1 = ready
    f0, f1 = free
    starts: list[float] = []
    ends: list[float] = []
    ran_out = False
    j = 0
    while True:
        if j == n0:  # lane 0's turn j
            ran_out = True
            break
        s = f0 if f0 > r0 else r0
        if not s < horizon or r1 <= s:
            break
        stage = t0s[j] / 2
        f0 = s + stage  # push_times: s >= f0
        r0 = f1 = (f0 if f0 > f1 else f1) + stage
        starts.append(s)
        ends.append(r0)
        if j == n1:  # lane 1's turn j
            ran_out = True
            break
        s = f0 if f0 > r1 else r1
        if not s < horizon or r0 <= s:
            break
        stage = t1s[j] / 2
        f0 = s + stage
        r1 = f1 = (f0 if f0 > f1 else f1) + stage
        starts.append(s)
        ends.append(r1)
        j += 1
    ready[0], ready[1] = r0, r1
    free[0], free[1] = f0, f1
    n = len(starts)
    predicted = [0.0] * n
    predicted[0::2] = t0s[: (n + 1) // 2]
    predicted[1::2] = t1s[: n // 2]
    return starts, predicted, ends, ran_out
