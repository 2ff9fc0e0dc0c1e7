"""Decode runs: many decode-only iterations planned and applied at once.

When nothing waits for a prefill and nothing is in flight, the next
iterations are certain to be decode-only batches of every running request,
until a request finishes, memory runs short, or a new request arrives. A
simulator (or a runtime doing multi-step decoding) can then take a whole run
of such iterations in two calls instead of three per iteration:

- :func:`plan_decode_run` prices the iterations exactly as ``schedule()``
  would, without changing anything;
- :func:`commit_decode_run` moves every request on by that many tokens, as
  ``schedule`` / ``on_stage_end`` / ``on_batch_end`` would have.

A run never contains the iteration in which a request finishes, one that
would need a preemption, or one whose KV would open a new KVP shard: those
go through ``schedule()`` as usual. Every sampled token is taken to be
``token_id`` (the simulator's convention) and no token stops a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from medha_sched.batch_cost import BatchCost, Work, chunk_works
from medha_sched.cost.base import AggregateCostModel
from medha_sched.decode_set import DecodeLanes, Lane
from medha_sched.kv_memory import KVBlockManager
from medha_sched.request import Request


def decode_run_limit(requests: Sequence[Request], memory: KVBlockManager, max_steps: int) -> int:
    """Most iterations that finish nobody, need no preemption and open no shard."""
    steps = max_steps
    for r in requests:
        steps = min(steps, r.max_output_tokens - r.num_output_tokens - 1)
    if steps <= 0:
        return 0
    # KV growth: iteration j (0-based) needs room for num_tokens + j tokens.
    while steps > 0:
        if kv_fits(memory, [(r, r.num_tokens + steps - 1) for r in requests]):
            return steps
        steps //= 2  # halve until it fits (runs are an optimisation, not exhaustive)
    return 0


def kv_fits(memory: KVBlockManager, wants: Sequence[tuple[Request, int]]) -> bool:
    """True when every ``(request, tokens)`` can grow to ``tokens`` of KV at once
    without a new KVP shard and without a preemption (the free blocks suffice)."""
    free = memory.free_blocks()
    bs, g = memory.cache.block_size, memory.group_limit
    need = [0] * len(free)
    for r, last in wants:
        groups = memory.groups_of(r.request_id)
        if last > len(groups) * g:
            return False
        tail_tokens = last - (len(groups) - 1) * g
        need[groups[-1]] += max(0, -(-tail_tokens // bs) - memory.tail_blocks(r.request_id))
    return all(n <= f for n, f in zip(need, free, strict=True))


def plan_decode_run(
    requests: Sequence[Request],
    memory: KVBlockManager,
    new_cost: Callable[[], BatchCost],
    group_limit: int,
    steps: int,
) -> list[float]:
    """Predicted seconds of each of ``steps`` decode-only iterations of ``requests``.

    Each iteration is priced as ``Scheduler._pack_decodes`` prices it: one
    work per request at its next position, added to an empty batch.
    """
    groups = [memory.groups_of(r.request_id) for r in requests]
    starts = [r.num_scheduled_tokens for r in requests]
    times = []
    for j in range(steps):
        works: list[Work] = []
        for gs, start in zip(groups, starts, strict=True):
            pos = start + j
            if pos < group_limit:
                works.append((gs[0], 1, pos, True))
            else:
                works.extend(chunk_works(gs, pos, 1, group_limit))
        cost = new_cost()
        cost.add(works)
        times.append(cost.time)
    return times


def plan_lane_run(
    lanes: DecodeLanes,
    lane: Lane,
    model: AggregateCostModel,
    steps: int,
    budget: float = float("inf"),
) -> list[float]:
    """What :func:`plan_decode_run` gives for a lane's decodes, in O(groups) a step.

    For cost models with ``affine_decode_features`` (see
    :mod:`medha_sched.decode_set`): the same integer totals, the same times.
    Stops early once the times add up to ``budget`` seconds (that last one
    included): a caller that cannot use more asks for no more.
    """
    group_time = model.group_time
    rows = lanes.totals(lane)
    if len(rows) == 1 and rows[0] is not None:  # one busy group: totals(lane, j) inline
        return lanes.one_group_times(
            lane, group_time, steps, budget, varying=model.group_time_varying
        )
    times = []
    spent = 0.0
    for j in range(steps):
        t = max(0.0 if t is None else group_time(t) for t in lanes.totals(lane, j))
        times.append(t)
        spent += t
        if spent >= budget:
            break
    return times


def commit_decode_run(
    requests: Sequence[Request], memory: KVBlockManager, steps: int, *, token_id: int = 0
) -> None:
    """Apply ``steps`` decode iterations to ``requests`` (see the module docstring)."""
    wants = [(r.request_id, r.num_tokens + steps - 1) for r in requests]
    failed = memory.ensure_capacity_many(wants)
    if failed:  # decode_run_limit checked the room: this is a bug, not a state
        raise AssertionError(f"a decode run ran out of KV memory for {failed}")
    for r in requests:
        memory.pop_new_blocks(r.request_id)
        r.num_scheduled_tokens += steps
        r.num_stage0_tokens += steps
        r.num_computed_tokens += steps
        r.output_token_ids.extend([token_id] * steps)
