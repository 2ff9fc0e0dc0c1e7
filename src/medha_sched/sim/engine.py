"""The event loop: a trace in, the real :class:`Scheduler` deciding, metrics out.

The executor is replaced by the cost model: a batch takes its
``predicted_time`` through a FIFO pipeline of ``spp`` stages
(:mod:`medha_sched.sim.pipeline`). The loop reports to the scheduler what a
runtime would: ``on_stage_end`` when a batch leaves stage 0 (``spp > 1``)
and ``on_batch_end`` when it leaves the last stage, in issue order. Every
sampling chunk samples a token; a request runs until it has generated its
``output_tokens``. KVP is the scheduler's and the cost model's business
(groups, shards and merges are in the predicted time).

Three shortcuts keep long simulations fast without changing any decision:
the scheduler is not asked for a batch when every live request is waiting
for a token from a batch in flight (the batch would be empty), and a batch
of decodes issued in that state gets no ``StageEnd`` event (leaving stage 0
would free nothing; ``on_batch_end`` clears stage 0 in its place, and an
arrival or batch end in the meantime asks for a wake-up instead). And when
nothing waits for a prefill and nothing is in flight, the decode-only
batches that are certain to end before the next arrival are planned and
applied in one go (``Scheduler.plan_decode_run`` / ``commit_decode_run``);
``decode_runs=False`` turns this off, and a test checks both give the same
records and iterations. Prefill turns beside the decodes go many in one call
(``Scheduler.turn_run``) until a turn the run does not take; ``turn_runs=False``
takes every turn on its own (tests check both give the same records).
Where prompts wait together, the batches the scan forms go as turns too when
none of their chunks samples (``turn_scans=False``: through ``schedule``).
"""

from __future__ import annotations

import gc
import heapq
import time as _time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter

from medha_sched.config import CacheConfig, SchedulerConfig
from medha_sched.cost.base import CostModel
from medha_sched.decode_set import ZERO_TOKENS
from medha_sched.errors import RequestTooLongError
from medha_sched.output import BatchResult
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler, TurnRun
from medha_sched.sim.cycles import cycle_turns
from medha_sched.sim.events import Arrival, BatchEnd, Event, ScheduleWakeup, StageEnd
from medha_sched.sim.metrics import IterationLog, IterationRows, RequestRecord
from medha_sched.sim.pipeline import Pipeline, push_times
from medha_sched.sim.trace import TraceRequest

_END = itemgetter(2)  # a batch in flight's end: (completes, sampling, end)


def _zeros(n: int) -> array:
    """``n`` zeros as int64 (a column of a run's records, extended by memcpy)."""
    return array("q", bytes(8 * n))


def _cycled(sizes: Sequence[int], n: int) -> array:
    """The first ``n`` items of ``sizes`` repeated, as int64 (copies of memory)."""
    return (array("q", sizes) * -(-n // len(sizes)))[:n]


class SimulationError(RuntimeError):
    """The simulation cannot go on (a scheduler that stopped making progress)."""


_RESULT = BatchResult(sampled_token_ids=ZERO_TOKENS)  # every sampling chunk sampled token 0


@dataclass(frozen=True, slots=True)
class SimResult:
    """A finished simulation.

    Attributes:
        records: one per trace request, in trace order.
        iterations: one per issued (non-empty) batch, in issue order (a sequence
            of :class:`~medha_sched.sim.metrics.IterationRecord` kept as columns).
        end_s: simulated time of the last event.
        wall_s: wall-clock seconds the simulation took.
        prefix_cache_queries: prompt tokens looked up in the prefix cache.
        prefix_cache_hits: of those, tokens found cached (not computed).
    """

    records: list[RequestRecord]
    iterations: IterationLog
    end_s: float
    wall_s: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Simulator:
    """One replica: the scheduler, a pipeline of ``cost_model.layout.spp`` stages.

    Args:
        config: the scheduler's policy and budget.
        cost_model: predicts each batch's latency; its ``layout`` gives tp/spp/kvp.
        cache: KV memory per KVP group. Its blocks are only counted
            (``block_ids=False``) unless the prefix cache is on and a request
            of the trace names a prefix: the simulator reads no block id.
        decode_runs: take certain runs of decode-only batches in one step
            (:mod:`medha_sched.decode_run`); same results, fewer calls.
        admission_delay_s: seconds from a request's arrival until the scheduler
            sees it: on a real server, HTTP, tokenisation, IPC and streaming the
            token back. TTFT and end-to-end latency still count from the arrival.
        turn_runs: with ``decode_runs``, take the common prefill turns many in
            one call (``Scheduler.turn_run``); same results, fewer calls.
        turn_scans: with ``decode_runs``, the batches the scan forms while
            prompts wait together go as prefill turns too where they are
            (``Scheduler.scan_turn``, and in runs); same results, fewer calls.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model: CostModel,
        *,
        cache: CacheConfig | None = None,
        decode_runs: bool = True,
        admission_delay_s: float = 0.0,
        turn_runs: bool = True,
        turn_scans: bool = True,
    ) -> None:
        if not 0.0 <= admission_delay_s < float("inf"):
            raise ValueError(
                f"admission_delay_s must be a finite number >= 0, got {admission_delay_s!r}"
            )
        self.config = config
        self.admission_delay_s = admission_delay_s
        self.cost_model = cost_model
        self.cache = cache if cache is not None else CacheConfig()
        self.spp = cost_model.layout.spp
        self.decode_runs = decode_runs
        self.turn_runs = turn_runs
        self.turn_scans = turn_scans

    def run(
        self, trace: Sequence[TraceRequest], *, progress: Callable[[int], None] | None = None
    ) -> SimResult:
        """Simulate ``trace`` to the end; ``progress(n)`` hears of every n requests done."""
        wall = _time.perf_counter()
        self.sched = Scheduler(self.config, self.cost_model, cache=_counted(self.cache, trace))
        self.sched.turn_scans = self.turn_scans
        self.pipeline = Pipeline(self.spp)
        self.now = 0.0
        self._trace = trace
        self._order = iter(sorted(range(len(trace)), key=lambda i: (trace[i].arrival_s, i)))
        self.records = [RequestRecord.from_trace(r) for r in trace]
        self._by_id = {r.id: rec for r, rec in zip(trace, self.records, strict=True)}
        self._live: dict[str, Request] = {}
        # batch -> (ids whose prefill it completes, how many of its chunks sample, end)
        self._in_flight: dict[int, tuple[list[str], int, float]] = {}
        self._awaiting = 0  # live requests waiting for a token from a batch in flight
        self.iterations = IterationLog()
        # the batches' records, gathered and moved into the log in blocks
        # (flushed before the log is written otherwise, and at the end)
        self._rows = IterationRows(self.iterations)
        self._progress = progress or (lambda n: None)
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self._wakeup_pending = False
        self._stage0_unwatched = False  # the batch in stage 0 has no StageEnd event
        self._run_len = 16  # decode-run length to plan next (doubles while runs last)
        self._cycle_len = 16  # lane-cycle turns per lane to plan next (likewise)
        self._push_next_arrival()
        collecting = gc.isenabled()
        gc.disable()  # the loop makes no cyclic garbage; collections only cost time
        try:
            heap, pop = self._heap, heapq.heappop
            while heap:
                self.now, _, _, event = pop(heap)
                event.handle(self)
        finally:
            if collecting:
                gc.enable()
        self._rows.flush()
        if self.sched.has_unfinished_requests():
            stuck = sorted(self._live)[:5]
            raise SimulationError(
                f"the scheduler stopped making progress at t={self.now:.3f}s with "
                f"{len(self._live)} requests unfinished (e.g. {stuck})"
            )
        return SimResult(
            self.records,
            self.iterations,
            self.now,
            _time.perf_counter() - wall,
            self.sched.prefix_cache_queries,
            self.sched.prefix_cache_hits,
        )

    # ------------------------------------------------------------- plumbing
    def push(self, event: Event) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (event.time, event.rank, self._seq, event))

    def _push_next_arrival(self) -> None:
        i = next(self._order, None)
        if i is not None:
            self.push(Arrival(self._trace[i].arrival_s + self.admission_delay_s, i))

    def _wake_if_free(self) -> None:
        """Ask for a batch at ``now``, after everything else happening at ``now``."""
        if self._wakeup_pending:
            return
        if not self.pipeline.stage0_free(self.now):
            if self._stage0_unwatched:  # no StageEnd will come: wake when stage 0 frees
                self._stage0_unwatched = False
                self._wakeup_pending = True
                self.push(ScheduleWakeup(self.pipeline.stage0_free_at))
            return
        heap = self._heap
        if heap and heap[0][0] <= self.now:
            self._wakeup_pending = True
            self.push(ScheduleWakeup(self.now))
        else:  # nothing else happens at this instant: the wake-up is the next event
            self.on_wakeup()

    # --------------------------------------------------------------- events
    def on_arrival(self, index: int) -> None:
        t = self._trace[index]
        request = Request(
            t.id,
            self.now,  # the scheduler's arrival: the trace's plus the admission delay
            t.prompt_tokens,
            t.output_tokens,
            ttft_slo=t.ttft_slo_s,
            tpot_slo=t.tpot_slo_s,
            priority=t.priority,
            prefix_id=t.prefix_id,
            prefix_tokens=t.prefix_tokens,
        )
        self._push_next_arrival()  # first: it may arrive at this same instant
        try:
            self.sched.add_request(request)
        except RequestTooLongError as exc:
            self.records[index].rejected = str(exc)
            self._progress(1)
            return
        self.records[index].deadline_s = request.deadline
        self._live[t.id] = request
        self._wake_if_free()

    def on_wakeup(self) -> None:
        self._wakeup_pending = False
        now = self.now
        if self._awaiting == len(self._live) or not self.pipeline.stage0_free(now):
            return  # every request waits for a token: the batch would be empty
        if self.decode_runs:
            queued = self.sched.num_queued
            if queued and (
                (queued == 1 and self._awaiting == 0 and self._lone_prefill(now))
                or (self.spp > 1 and self._prefill_turns(now))
            ):
                return  # the prefill's chunks went in bulk
            if self._awaiting == 0:
                now = self._decode_run(now)
            elif self.spp > 1 and self._lane_cycle(now):
                return  # every decode is in flight again
        # only the batch's shape: no ScheduleOutput (Scheduler.schedule_plain)
        self._issue(now, *self.sched.schedule_plain(now))

    def _issue(
        self,
        now: float,
        bid: int,
        predicted: float,
        n_decode: int,
        chunks: list[tuple[str, int, bool]],
        preempted: int,
    ) -> None:
        """The batch ``Scheduler.schedule_plain`` formed at ``now``, into the pipeline."""
        if not chunks and not n_decode:
            return  # blocked until a batch ends; its event wakes us again
        n_prefill, prefill_tokens, completes = len(chunks), 0, []
        for rid, n, samples in chunks:
            prefill_tokens += n
            if samples:
                completes.append(rid)
        self._rows.append(bid, now, predicted, n_decode, n_prefill, prefill_tokens, preempted)
        sampling = n_decode + len(completes)  # every decode samples
        self._awaiting += sampling
        stage0_end, end = self.pipeline.push(now, predicted / self.spp)
        self._in_flight[bid] = (completes, sampling, end)
        if self.spp > 1:
            self._stage0_unwatched = n_prefill == 0 and self._awaiting == len(self._live)
            if not self._stage0_unwatched:
                self.push(StageEnd(stage0_end, bid))
        self.push(BatchEnd(end, bid))

    def _decode_run(self, now: float) -> float:
        """Issue and end, at once, the decode-only batches certain to come before
        the next event; returns the time the last one ended (``now`` if none).

        Same decisions, times and records as going one batch at a time: a
        batch joins the run only if it ends strictly before the next event.
        """
        horizon = self._heap[0][0] if self._heap else float("inf")
        # nothing is in flight: every batch of the run holds the pipeline for its whole time
        times = self.sched.plan_decode_run(self._run_len, horizon - now)
        if not times:
            return now
        spp, starts = self.spp, []
        free = self.pipeline.free  # a copy
        if not free[-1] <= now:  # nothing is in flight: every batch has left the pipeline
            raise SimulationError(f"a decode run at t={now} with stages busy until {free}")
        # Every stage is free when each batch of the run is issued (at the end of
        # the one before), so Pipeline.push's max(arrival, free) always picks the
        # arrival: a batch leaves stage k at its start plus k + 1 stage times,
        # added one at a time.
        # ``t`` ends as the last batch's end.
        t, append = now, starts.append
        if spp == 2:  # the loop below with its one stage added inline (the same sums)
            for predicted in times:
                stage = predicted / spp
                end = t + stage + stage
                if not end < horizon:
                    break
                append(t)
                t = end
        else:
            for predicted in times:
                stage = predicted / spp
                end = t + stage
                for _ in range(1, spp):
                    end += stage
                if not end < horizon:
                    break
                append(t)
                t = end
        n = len(starts)
        self._run_len = min(2 * self._run_len, 4096) if n == len(times) else 16
        if n == 0:
            return now
        stage = times[n - 1] / spp
        x = starts[-1]
        for k in range(spp):
            x += stage
            free[k] = x
        self.pipeline.free = free
        ids = self.sched.commit_decode_run(starts)  # n ids
        zeros = _zeros(n)
        self._rows.flush()  # (a long run's arrays go in as they are)
        self.iterations.extend(
            ids,
            starts,
            times[:n] if n < len(times) else times,
            array("q", (len(self._live),)) * n,
            zeros,
            zeros,
            zeros,
        )
        self.now = t
        return t

    def _horizon(self) -> float:
        """When the next event comes, the ends of the batches in flight left out."""
        in_flight, horizon = self._in_flight, float("inf")
        for entry in self._heap:
            event = entry[3]
            if entry[0] < horizon and not (type(event) is BatchEnd and event.batch_id in in_flight):
                horizon = entry[0]
        return horizon

    def _drop_batch_ends(self, batch_ids: set[int]) -> None:
        """Take the ``BatchEnd`` events of ``batch_ids`` out of the event heap
        (batches a bulk path already ended)."""
        heap = self._heap
        heap[:] = [e for e in heap if not (type(e[3]) is BatchEnd and e[3].batch_id in batch_ids)]
        heapq.heapify(heap)

    def _lane_cycle(self, now: float) -> bool:
        """Issue, at once, the decode-only batches of lanes taking turns in the
        pipeline (``Scheduler.plan_lane_cycle``) before the next event; True
        if it did (then every decode is in flight again, as after issuing the
        last of them one at a time).

        The turns: :func:`~medha_sched.sim.cycles.cycle_turns`, up to the
        next other event.
        """
        if self.sched.num_queued:
            return False  # a prompt waits: the next batch may carry a chunk
        in_flight = self._in_flight
        horizon = self._horizon()
        # a turn holds stage 0 for its time / spp
        plan = self.sched.plan_lane_cycle(self._cycle_len, (horizon - now) * self.spp)
        if plan is None:
            return False
        k = len(plan.lanes)
        ready = [now] + [in_flight[b][2] for b in plan.in_flight]  # when each lane is ready
        free = self.pipeline.free  # a copy
        starts, predicted, ends, ran_out = cycle_turns(plan.times, ready, free, horizon)
        n = len(starts)
        self._cycle_len = min(2 * self._cycle_len, 4096) if ran_out else 16
        if n < k:
            return False
        first = self.sched.commit_lane_cycle(plan, n, starts[-1]).start
        for b in plan.in_flight:
            self._awaiting -= in_flight.pop(b)[1]
        self._drop_batch_ends(set(plan.in_flight))
        sizes, zeros = plan.sizes, _zeros(n)
        self._rows.flush()  # (a long cycle's arrays go in as they are)
        self.iterations.extend(
            range(first, first + n),
            starts,
            predicted,
            _cycled(sizes, n),
            zeros,
            zeros,
            zeros,
        )
        self.pipeline.free = free
        for i in range(n - k, n):
            size = sizes[i % k]
            in_flight[first + i] = ([], size, ends[i])
            self._awaiting += size
            self.push(BatchEnd(ends[i], first + i))
        self._stage0_unwatched = True  # every lane is in flight: no StageEnd was pushed
        self.now = starts[-1]
        return True

    def _lone_prefill(self, now: float) -> bool:
        """Issue, at once, the chunks of a prefill that runs alone
        (``Scheduler.lone_prefill``) before the next event; True if it did.

        Going one batch at a time, each chunk is issued when the previous one
        clears stage 0 (its ``StageEnd``); batch ends in between only move
        the prefill's cursors. The turns stop before one that would not come
        strictly before the next other event, that finds no chunk fitting, or
        that would end the prefill.
        """
        request = self.sched.lone_prefill()
        if request is None:
            return False
        in_flight = self._in_flight
        horizon = self._horizon()
        free = self.pipeline.free
        spp = self.spp
        turn = self.sched.lone_prefill_turn
        starts: list[float] = []
        chunks: list[int] = []
        predicted: list[float] = []
        stage0_ends: list[float] = []
        ends: list[float] = []
        s = now
        while s < horizon:
            got = turn(request, s, cleared=bool(starts))
            if got is None:
                break
            n, p = got
            f, t = push_times(free, s, p / spp)  # Pipeline.push, on the copy
            starts.append(s)
            chunks.append(n)
            predicted.append(p)
            stage0_ends.append(f)
            ends.append(t)
            s = f  # the next chunk goes when this one clears stage 0
        m = len(starts)
        if m == 0:
            return False
        last = starts[-1]
        done = [b for b, v in in_flight.items() if v[2] <= last]
        ended = sum(1 for e in ends if e <= last)
        first = self.sched.commit_lone_prefill(request, chunks, m - 1, ended, done).start
        if done:
            for b in done:
                del in_flight[b]
            self._drop_batch_ends(set(done))
        zeros = [0] * m
        self._rows.extend(range(first, first + m), starts, predicted, zeros, [1] * m, chunks, zeros)
        self.pipeline.free = free
        for i in range(ended, m):
            in_flight[first + i] = ([], 0, ends[i])
        self.push(StageEnd(stage0_ends[-1], first + m - 1))
        for i in range(ended, m):
            self.push(BatchEnd(ends[i], first + i))
        self._stage0_unwatched = False
        self.now = last
        return True

    def _prefill_turns(self, now: float) -> bool:
        """Issue a prefill's chunks beside the ready decodes, one turn per stage-0
        clearing (``Scheduler.turns_prefill``), without events, up to the next
        other event; True if at least one turn went.

        Between turns the batch ends due by then are handled as their events
        would be (finished requests included), then the last turn's stage-0
        clearing. A turn that ``prefill_turn`` refuses goes through
        ``schedule`` (a wake-up at its time), but where prompts wait together
        (``Scheduler.scan_turns``): then the scan forms it
        (``Scheduler.scan_turn``), a turn if none of its chunks samples, else a
        batch as ``schedule_plain``'s issued at once, which ends the turns.
        SPP > 1 (with one stage a batch clears stage 0 when it ends).
        """
        request = self.sched.turns_prefill(now)
        if request is None and not self.sched.scan_turns(now):
            return False
        if self.sched.num_queued > 1:
            request = None  # prompts wait together: each turn takes the first, or the scan's batch
        in_flight = self._in_flight
        horizon = self._horizon()
        sched = self.sched
        free = self.pipeline.free
        spp = self.spp
        append = self._rows.append
        issued: list[int] = []
        gone: set[int] = set()
        s = now
        queued = False
        plain = None  # a batch the scan formed that is no turn: it goes as schedule_plain's
        bulk = self.turn_runs
        while True:
            if bulk:  # the common turns in one call (Scheduler.turn_run)
                bulk = False  # after a run, one turn goes the per-turn way
                ends = list(map(_END, in_flight.values()))
                run = sched.turn_run(request, s, horizon, free, ends)
                if run is not None:
                    s = self._apply_turn_run(run, issued, gone)
                    if run.plain is not None:
                        plain = run.plain
                        break  # the scan's batch at s, no turn
                    if not run.cleared:
                        break  # its stage-0 end is an event of its own
            got = sched.prefill_turn(request, s)
            if got is not None:
                bid, n, p, decodes = got
                append(bid, s, p, decodes, 1, n, 0)
            elif request is None and sched.turn_scans:  # prompts together: the scan's batch
                *formed, turn = sched.scan_turn(s)
                if not turn:
                    plain = formed
                    break
                bid, p, decodes, chunks, _ = formed
                append(bid, s, p, decodes, len(chunks), sum(c[1] for c in chunks), 0)
            else:
                queued = bool(issued)  # its last chunk cleared stage 0: it waits again
                break
            f, t = push_times(free, s, p / spp)  # Pipeline.push, on the copy
            in_flight[bid] = ([], decodes, t)
            self._awaiting += decodes
            issued.append(bid)
            self.now = s
            if not f < horizon:
                break  # its stage-0 end is an event of its own
            # what happens up to f: batch ends (in order), then bid clears stage 0
            while True:
                b = next(iter(in_flight))  # bid at least is in flight
                end = in_flight[b][2]
                if end > f:
                    break
                self.now = end
                self._end_batch(b)
                gone.add(b)
            sched.clear_turn(bid)
            s = f
            bulk = self.turn_runs
        if not issued:
            if plain is None:
                return False
            self._issue(s, *plain)
            return True
        sched.end_prefill_turns(request, len(issued), queued)
        self.pipeline.free = free
        if gone:
            self._drop_batch_ends(gone)
        for b in issued:
            if b in in_flight:
                self.push(BatchEnd(in_flight[b][2], b))
        self._stage0_unwatched = False
        if plain is not None:  # every turn cleared stage 0: the batch goes at s
            self.now = s
            self._issue(s, *plain)
        elif queued:
            self.now = s
            self._wakeup_pending = True
            self.push(ScheduleWakeup(s))
        else:
            self.push(StageEnd(free[0], issued[-1]))
        return True

    def _apply_turn_run(self, run: TurnRun, issued: list[int], gone: set[int]) -> float:
        """The simulator's side of a :class:`TurnRun` (records, batches in flight,
        ``now``), as the per-turn loop leaves it; returns the next turn's time."""
        in_flight = self._in_flight
        for _ in range(run.ended):  # the oldest batches in flight before the run
            b = next(iter(in_flight))
            self._awaiting -= in_flight.pop(b)[1]
            gone.add(b)
        starts, decodes, ends = run.starts, run.decodes, run.ends
        first, m = run.ids.start, len(starts)
        if not m:
            return run.next_start  # only a batch that is no turn (run.plain)
        self._rows.extend(
            range(first, first + m), starts, run.times, decodes, run.prefills, run.chunks, [0] * m
        )
        for i in range(run.ended_turns, len(starts)):
            in_flight[first + i] = ([], decodes[i], ends[i])
            self._awaiting += decodes[i]
        issued.extend(run.ids)
        # (the per-turn loop moves ``now`` on to each batch end too; whatever
        # follows a run sets it again before it is read)
        self.now = starts[-1]
        return run.next_start if run.cleared else starts[-1]

    def on_stage_end(self, batch_id: int) -> None:
        self.sched.on_stage_end(batch_id)
        self._wake_if_free()

    def on_batch_end(self, batch_id: int) -> None:
        self._end_batch(batch_id)
        self._wake_if_free()

    def _end_batch(self, batch_id: int) -> None:
        """``on_batch_end`` less the wake-up."""
        now = self.now
        completes, sampling, _ = self._in_flight.pop(batch_id)
        self._awaiting -= sampling
        for rid in completes:
            rec = self._by_id[rid]
            if rec.first_token_s is None:
                rec.first_token_s = now
        finished = self.sched.on_batch_end(batch_id, _RESULT)
        for rid in finished:
            rec = self._by_id[rid]
            rec.finish_s = now
            rec.preemptions = self._live.pop(rid).num_preemptions
        if finished:
            self._progress(len(finished))


def _counted(cache: CacheConfig, trace: Sequence[TraceRequest]) -> CacheConfig:
    """``cache``, its blocks only counted (``block_ids=False``: O(1) per allocation
    and release, the same decisions) unless the prefix cache may share some: the
    simulator reads no block id, only the free counts."""
    if not cache.block_ids:
        return cache
    if cache.enable_prefix_caching and any(t.prefix_id is not None for t in trace):
        return cache
    return replace(cache, block_ids=False)


def simulate(
    trace: Sequence[TraceRequest],
    config: SchedulerConfig,
    cost_model: CostModel,
    *,
    cache: CacheConfig | None = None,
    progress: Callable[[int], None] | None = None,
    decode_runs: bool = True,
    admission_delay_s: float = 0.0,
    turn_runs: bool = True,
    turn_scans: bool = True,
) -> SimResult:
    """Run ``trace`` through one replica; see :class:`Simulator`."""
    sim = Simulator(
        config,
        cost_model,
        cache=cache,
        decode_runs=decode_runs,
        admission_delay_s=admission_delay_s,
        turn_runs=turn_runs,
        turn_scans=turn_scans,
    )
    return sim.run(trace, progress=progress)
