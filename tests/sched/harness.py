"""Drive a Scheduler like an executor would, checking invariants on every batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha_sched.batch_cost import chunk_works
from medha_sched.cost.base import BatchWork, RequestWork
from medha_sched.output import BatchResult, ScheduleOutput
from medha_sched.policies import relative_slack
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler

EPS = 1e-9


@dataclass
class Trace:
    outputs: list[ScheduleOutput] = field(default_factory=list)
    finished: dict[str, Request] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    prefill_sums: dict[str, int] = field(default_factory=dict)
    iterations: int = 0


def batch_work(sched: Scheduler, out: ScheduleOutput, upto: int | None = None) -> BatchWork:
    groups: list[list[RequestWork]] = [[] for _ in range(sched.layout.kvp)]
    for chunk in out.chunks[:upto]:
        for g, q, kv, tail in chunk_works(
            chunk.kvp_groups, chunk.start, chunk.num_tokens, sched.group_limit
        ):
            groups[g].append(RequestWork(q, kv, tail))
    return BatchWork(groups=tuple(tuple(x) for x in groups))


def with_chunk(sched: Scheduler, base: BatchWork, groups, start: int, n: int) -> BatchWork:
    items = [list(x) for x in base.groups]
    for g, q, kv, tail in chunk_works(groups, start, n, sched.group_limit):
        items[g].append(RequestWork(q, kv, tail))
    return BatchWork(groups=tuple(tuple(x) for x in items))


class Checker:
    """Checks one batch against the scheduler's state just before and after it."""

    def __init__(self, sched: Scheduler, trace: Trace) -> None:
        self.s = sched
        self.t = trace

    def before(self) -> dict[str, Request]:
        """Snapshot of decode-ready requests."""
        return {
            r.request_id: r
            for r in self.s._running.values()
            if not r.is_prefilling and r.num_scheduled_tokens < r.num_tokens
        }

    def check(self, out: ScheduleOutput, ready: dict[str, Request], starts: dict) -> None:
        s, cfg = self.s, self.s.config
        ready = {k: v for k, v in ready.items() if k not in out.preempted}
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), f"request twice in batch {out.batch_id}: {ids}"
        assert len(ids) <= cfg.max_batch_requests
        decode_ids = [c.request_id for c in out.chunks if c.request_id in ready]
        n_dec = len(decode_ids)
        assert ids[:n_dec] == decode_ids, "decodes must come first"
        missing = set(ready) - set(decode_ids) - set(out.preempted)
        assert not missing or len(ids) >= cfg.max_batch_requests, f"decodes left out: {missing}"
        for c in out.chunks:
            r = starts[c.request_id][0]
            assert c.num_tokens >= 1
            assert not r.status.finished or c.request_id in s._requests
            expected = 0 if c.request_id in out.preempted else starts[c.request_id][1]
            if expected == 0 and c.request_id not in ready:
                expected = r.num_cached_tokens  # admitted now: the cached prefix is computed
            assert c.start == expected, "chunk must start at the issued cursor"
            if c.request_id not in ready:
                assert c.start + c.num_tokens <= r.num_prefill_tokens, "chunk beyond prompt"
                lo = c.start // s.group_limit
                assert (c.start + c.num_tokens - 1) // s.group_limit == lo, "chunk crosses shard"
        self._check_budget(out, n_dec, starts)
        self._check_long(out, n_dec)
        s.memory.check_invariants()
        for g in range(s.layout.kvp):
            assert s.memory.num_used_blocks(g) <= s.cache.num_blocks_per_group

    def _check_budget(self, out: ScheduleOutput, n_dec: int, starts: dict) -> None:
        s = self.s
        full = s.cost_model.predict(batch_work(s, out))
        assert math.isclose(full, out.predicted_time, rel_tol=1e-9, abs_tol=1e-12)
        if not s.config.adaptive or self._forced(out, n_dec, starts):
            return
        if len(out.chunks) > n_dec:
            assert out.predicted_time <= out.target_time * (1 + EPS), (
                f"batch {out.batch_id} over budget: {out.predicted_time} > {out.target_time}"
            )
        for i in range(n_dec, len(out.chunks)):
            self._check_optimal(out, i, starts)

    def _forced(self, out: ScheduleOutput, n_dec: int, starts: dict) -> bool:
        """The budget's liveness exception (``Scheduler._force_progress``): with nothing
        decoding or in flight and no chunk fitting its target, the batch is one chunk of
        one grid step (or what is left of its shard or prompt), over the budget."""
        s = self.s
        if n_dec or len(out.chunks) != 1 or list(s._in_flight) != [out.batch_id]:
            return False
        c = out.chunks[0]
        r = starts[c.request_id][0]
        limit = min(
            r.num_prefill_tokens - c.start,
            s.config.max_chunk_tokens,
            s.group_limit - c.start % s.group_limit,
        )
        prefix = batch_work(s, out, upto=0)
        t = s.cost_model.predict(with_chunk(s, prefix, c.kvp_groups, c.start, c.num_tokens))
        if t <= self._target_for(r, out) * (1 + EPS):
            return False  # it fits: an ordinary chunk, checked as such
        assert c.num_tokens == min(s.config.token_grid, limit), "a forced chunk is one grid step"
        return True

    def _target_for(self, r: Request, out: ScheduleOutput) -> float:
        s = self.s
        target = out.target_time
        if r.num_prefill_tokens >= s.config.long_prefill_threshold and s.policy.space_sharing:
            rho = min(s.config.max_space_share, max(0.0, relative_slack(r, out.time)))
            target *= 1 - rho
        return target

    def _check_optimal(self, out: ScheduleOutput, i: int, starts: dict) -> None:
        """The chunk is the largest grid chunk that fits its target."""
        s, c = self.s, out.chunks[i]
        r = starts[c.request_id][0]
        target = self._target_for(r, out)
        prefix = batch_work(s, out, upto=i)
        t_with = s.cost_model.predict(with_chunk(s, prefix, c.kvp_groups, c.start, c.num_tokens))
        assert t_with <= target * (1 + EPS), "chunk overshoots its own target"
        limit = min(
            r.num_prefill_tokens - c.start,
            s.config.max_chunk_tokens,
            s.group_limit - c.start % s.group_limit,
        )
        if c.num_tokens >= limit:
            return
        grid = s.config.token_grid
        assert c.num_tokens % grid == 0, f"non-final chunk {c.num_tokens} off the grid"
        bigger = min(c.num_tokens + grid, limit)
        t_big = s.cost_model.predict(with_chunk(s, prefix, c.kvp_groups, c.start, bigger))
        assert t_big > target * (1 - EPS), f"chunk {c.num_tokens} not maximal: {bigger} fits"

    def _check_long(self, out: ScheduleOutput, n_dec: int) -> None:
        s = self.s
        if not s.config.adaptive:
            return
        seen: set[int] = set()
        for c in out.chunks[n_dec:]:
            r = s._requests.get(c.request_id)
            if r is None or r.num_prefill_tokens < s.config.long_prefill_threshold:
                continue
            assert not seen.intersection(c.kvp_groups), "two long prefills share a KVP group"
            seen.update(c.kvp_groups)


def token_for(request_id: str, position: int) -> int:
    return (hash((request_id, position)) & 0xFFFF) + 1


def run(sched: Scheduler, requests: list[Request], *, max_iters: int = 20_000) -> Trace:
    """Run to completion with an executor that takes ``predicted_time`` per batch.

    The executor is a FIFO pipeline of ``spp`` stages, each busy for
    predicted/spp per batch: a batch clears stage 0 when its first stage is
    done and ends after the last; a new batch starts once stage 0 is free.
    """
    trace = Trace()
    checker = Checker(sched, trace)
    pending = sorted(requests, key=lambda r: r.arrival_time)
    now, spp = 0.0, sched.layout.spp
    stage_free = [0.0] * spp
    in_flight: list[tuple[float, float, int]] = []  # (stage0 end, end, batch id), FIFO
    while pending or sched.has_unfinished_requests():
        trace.iterations += 1
        assert trace.iterations <= max_iters, "no progress: liveness violated"
        while pending and pending[0].arrival_time <= now:
            r = pending.pop(0)
            sched.add_request(r)
            trace.deadlines[r.request_id] = r.deadline
        out = None
        if stage_free[0] <= now:
            ready = checker.before()
            starts = {r.request_id: (r, r.num_scheduled_tokens) for r in sched._requests.values()}
            out = sched.schedule(now)
            checker.check(out, ready, starts)
            trace.outputs.append(out)
            _track_prefill(trace, out, ready, starts)
            if out.chunks:
                in_flight.append(
                    (*_occupy(stage_free, now, out.predicted_time / spp), out.batch_id)
                )
        for rid, d in trace.deadlines.items():
            r = sched.get_request(rid)
            if r is not None:
                assert r.deadline == d, f"deadline of {rid} moved"
        now = _advance(sched, trace, in_flight, pending, now, stage_free[0])
    return trace


def _occupy(stage_free: list[float], now: float, stage_time: float) -> tuple[float, float]:
    """Push a batch through the pipeline; returns (stage-0 end, last-stage end)."""
    t, first = now, None
    for k in range(len(stage_free)):
        t = max(t, stage_free[k]) + stage_time
        stage_free[k] = t
        first = t if first is None else first
    assert first is not None
    return first, t


def _track_prefill(trace: Trace, out: ScheduleOutput, ready: dict, starts: dict) -> None:
    ready = {k: v for k, v in ready.items() if k not in out.preempted}
    for rid in out.preempted:
        trace.prefill_sums.pop(rid, None)
    for c in out.chunks:
        if c.request_id in ready:
            continue
        total = trace.prefill_sums.get(c.request_id, 0) + c.num_tokens
        r = starts[c.request_id][0]
        if c.start == 0:
            total = c.num_tokens
        elif c.request_id not in trace.prefill_sums and c.start == r.num_cached_tokens:
            total = c.start + c.num_tokens  # the first chunk after a cache hit
        assert total == c.start + c.num_tokens, "chunks must be contiguous"
        trace.prefill_sums[c.request_id] = total
        if c.samples:
            assert total == r.num_prefill_tokens, "chunks must sum to the prompt"


def _advance(sched, trace, in_flight, pending, now, stage0_free) -> float:
    events = [s0 for s0, _, _ in in_flight if s0 > now] + [end for _, end, _ in in_flight]
    if stage0_free > now:
        events.append(stage0_free)
    if pending:
        events.append(pending[0].arrival_time)
    if not events:
        return now + 1e-3  # nothing will happen: the liveness bound catches a stall
    nxt = max(min(events), now)
    for s0, _, bid in in_flight:
        if s0 <= nxt:
            sched.on_stage_end(bid)
    while in_flight and in_flight[0][1] <= nxt:
        _finish_batch(sched, trace, in_flight.pop(0)[2])
    return nxt


def _finish_batch(sched: Scheduler, trace: Trace, batch_id: int) -> None:
    out = next(o for o in reversed(trace.outputs) if o.batch_id == batch_id)
    sampled = {c.request_id: token_for(c.request_id, c.start) for c in out.chunks if c.samples}
    requests = {c.request_id: sched.get_request(c.request_id) for c in out.chunks}
    for rid in sched.on_batch_end(batch_id, BatchResult(sampled_token_ids=sampled)):
        trace.finished[rid] = requests[rid]
