"""The reference scheduler: ``medha_sched.Scheduler`` as it was before issue 20.

A frozen copy (with ``packer``, ``batch_cost`` and ``decode_run`` next to it)
of the algorithm that re-reads every running decode at every step: each is
checked for KV capacity, priced and emitted. It is the oracle the
incremental scheduler must agree with batch for batch (``tests/sched/
test_incremental.py``) and the baseline ``benchmarks/scheduler.py`` times it
against. ``queue=`` swaps the prefill queue (``ResortQueue`` gives a
vidur-style full re-sort at every step). Only the output type changed: the
decodes are given in full (``DecodeBatch.from_chunks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from medha_sched.config import CacheConfig, SchedulerConfig
from medha_sched.cost.base import CostModel
from medha_sched.errors import RequestTooLongError, SchedulerError
from medha_sched.kv_memory import KVBlockManager
from medha_sched.output import BatchResult, DecodeBatch, ScheduledChunk, ScheduleOutput
from medha_sched.policies import get_policy
from medha_sched.policies.base import Policy
from medha_sched.prefill_cache import PrefillTimeCache
from medha_sched.queue import PrefillQueue
from medha_sched.request import Request, RequestStatus

from .batch_cost import BatchCost, Work, chunk_works
from .decode_run import commit_decode_run, decode_run_limit, plan_decode_run
from .packer import ChunkSizer, Draft


@dataclass
class _InFlight:
    entries: list[tuple[Request, int, int, bool]]  # request, start, tokens, samples
    stage0_cleared: bool = False


class ReferenceScheduler:
    """Medha's replica scheduler, re-reading every decode at every step.

    Args:
        config: batching policy and budget.
        cost_model: predicts iteration times; its ``layout`` gives tp/spp/kvp.
        cache: KV memory per KVP group.
        queue: builds the prefill queue from the policy (default ``PrefillQueue``).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model: CostModel,
        *,
        cache: CacheConfig | None = None,
        queue: Callable[[Policy], PrefillQueue] = PrefillQueue,
    ) -> None:
        self.config = config
        self.cost_model = cost_model
        self.cache = cache if cache is not None else CacheConfig()
        self.layout = cost_model.layout
        self.policy = get_policy(config.policy)
        self.memory = KVBlockManager(self.cache, num_groups=self.layout.kvp)
        self.group_limit = self.cache.group_token_limit
        self.prefill_times = PrefillTimeCache(
            cost_model,
            target_time=config.target_batch_time,
            token_grid=config.token_grid,
            max_chunk_tokens=config.max_chunk_tokens,
            group_token_limit=self.group_limit,
        )
        self._sizer = ChunkSizer(config, self.policy, self.group_limit)
        self._adaptive = config.adaptive
        self._queue = queue(self.policy)
        self._requests: dict[str, Request] = {}
        self._running: dict[str, Request] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._abort_pending: set[str] = set()
        self._next_batch_id = 0
        self._clock = float("-inf")
        self.num_preemptions = 0

    # ----------------------------------------------------------------- intake
    @property
    def max_context_tokens(self) -> int:
        """Most tokens (prompt + output) one request may ever hold."""
        return self.layout.kvp * self.group_limit

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt that can be admitted (whole-prompt reservation)."""
        usable = (
            self.cache.num_blocks_per_group - self.cache.watermark_blocks
        ) * self.cache.block_size
        prompt = self.max_context_tokens if usable >= self.group_limit else usable
        if self.config.adaptive:
            prompt = min(prompt, self.prefill_times.max_feasible_tokens)
        return int(prompt)

    def add_request(self, request: Request) -> None:
        """Accept a new request; its deadline is fixed here for good."""
        rid = request.request_id
        if rid in self._requests:
            raise SchedulerError(f"request id {rid!r} is already in the scheduler")
        # Pricing the prompt first extends the prefill table to its length, so
        # the feasibility check below sees every position the prompt covers.
        p = self.prefill_times.remaining_time(request.num_prefill_tokens, 0)
        self._check_fits(request)
        if request.ttft_slo is not None:
            d = request.ttft_slo
        else:
            d = max(self.config.deadline_multiplier * p, self.config.min_deadline)
        request.deadline = request.arrival_time + d
        request.total_work = request.remaining_work = p
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self._queue.push(request)

    def _check_fits(self, request: Request) -> None:
        total = request.num_prompt_tokens + request.max_output_tokens
        if total > self.max_context_tokens:
            raise RequestTooLongError(
                f"request {request.request_id!r} needs {total} tokens (prompt "
                f"{request.num_prompt_tokens} + max_output_tokens {request.max_output_tokens}) "
                f"but the maximum context is {self.max_context_tokens} tokens"
            )
        if request.num_prefill_tokens > self.max_prompt_tokens:
            raise RequestTooLongError(
                f"request {request.request_id!r} has a {request.num_prefill_tokens}-token prompt; "
                f"the longest prompt this configuration can prefill is {self.max_prompt_tokens} "
                "tokens (KV memory, or a chunk alone exceeding target_batch_time)"
            )

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its KV is freed now, or when its in-flight batch ends."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.in_flight:
            self._abort_pending.add(request_id)
            self._queue.remove(request_id)
        else:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    # ---------------------------------------------------------------- queries
    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._requests) - len(self._running)

    @property
    def num_in_flight_batches(self) -> int:
        return len(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # --------------------------------------------------------------- schedule
    def schedule(self, now: float) -> ScheduleOutput:
        """Form the next batch at time ``now`` (seconds, never decreasing)."""
        if now < self._clock:
            raise SchedulerError(f"time went backwards: now={now} < previous {self._clock}")
        self._clock = now
        draft = Draft(BatchCost(self.cost_model, self.layout.kvp), self._target_time())
        preempted = self._pack_decodes(draft, now)
        self._pack_prefills(draft, now)
        return self._emit(draft, now, preempted)

    def _target_time(self) -> float:
        target = self.config.target_batch_time
        for r in self._running.values():
            if r.tpot_slo is not None and not r.is_prefilling:
                target = min(target, r.tpot_slo)
        return target

    def _pack_decodes(self, draft: Draft, now: float) -> list[str]:
        ready: list[Request] = []
        wants: list[tuple[str, int]] = []  # (id, tokens its KV must hold)
        for r in self._running.values():
            issued, total = r.num_scheduled_tokens, r.num_prompt_tokens + len(r.output_token_ids)
            if r.num_prefill_tokens <= issued < total:
                ready.append(r)
                wants.append((r.request_id, total))
        short = set(self.memory.ensure_capacity_many(wants))
        preempted: list[str] = []
        chosen = ready  # everything in _running is RUNNING until a preemption
        if short:
            for r in ready:
                if r.request_id in short and r.status is RequestStatus.RUNNING:
                    preempted.extend(self._make_room(r, now))
            chosen = [r for r in ready if r.status is RequestStatus.RUNNING]
        if len(chosen) > self.config.max_batch_requests:
            chosen = chosen[: self.config.max_batch_requests]
        works: list[Work] = []
        groups_of, limit, known = self.memory.groups_of, self.group_limit, draft.groups
        for r in chosen:
            groups = known[r.request_id] = groups_of(r.request_id)
            pos = r.num_scheduled_tokens
            if pos < limit:  # one shard: the common case, inlined
                works.append((groups[0], 1, pos, True))
            else:
                works.extend(chunk_works(groups, pos, 1, limit))
        draft.add_decodes(chosen, works)
        self._num_decodes = len(chosen)
        return preempted

    def _make_room(self, request: Request, now: float) -> list[str]:
        """Grow ``request`` by a block, preempting the worst requests if needed."""
        victims: list[str] = []
        while not self.memory.ensure_capacity(request.request_id, request.num_tokens):
            victim = self._pick_victim(request, now)
            self._preempt(victim)
            victims.append(victim.request_id)
            if victim is request:
                break
        return victims

    def _pick_victim(self, needy: Request, now: float) -> Request:
        groups = self.memory.groups_of(needy.request_id)
        shard_full = needy.num_tokens > len(groups) * self.group_limit
        holders = None if shard_full else self.memory.holders(groups[-1])
        candidates = [
            r
            for r in self._running.values()
            if not r.in_flight and (holders is None or r.request_id in holders)
        ]
        # a request grown past what memory admits with the watermark is no victim
        # while another can be preempted (it would wait forever after a recompute)
        limit = self.memory.max_admit_tokens
        able = [r for r in candidates if r.num_tokens <= limit]
        return max(able or candidates, key=lambda r: (self.policy.key(r, now), r.arrival_time))

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the KV, keep the deadline, prefill again."""
        rid = request.request_id
        self.memory.free(rid)
        del self._running[rid]
        request.num_prefill_tokens = request.num_tokens
        request.num_scheduled_tokens = request.num_stage0_tokens = request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.total_work = request.remaining_work = self.prefill_times.remaining_time(
            request.num_prefill_tokens, 0
        )
        self._queue.push(request)

    def _pack_prefills(self, draft: Draft, now: float) -> None:
        if not self._queue:
            return
        cfg = self.config
        chosen: list[Request] = []
        skips = 0
        grid, max_skips = cfg.token_grid, cfg.max_consecutive_skips
        entries, max_entries = draft.entries, cfg.max_batch_requests
        # With adaptive chunking a long prompt cannot join once every KVP
        # group runs a long prefill in this batch (see ChunkSizer.adaptive).
        long_min = cfg.long_prefill_threshold if self._adaptive else None
        long_groups, kvp = draft.long_groups, self.layout.kvp
        spent = None  # _budget_spent(draft), evaluated again only after the draft changes
        first = True
        for r in self._queue.iter_sorted(now):
            if len(entries) >= max_entries:
                break
            if first:  # the floor probes only pay off once a candidate has been passed over
                first = False
                if self._adaptive and draft.cost.time >= draft.target:
                    break
            elif spent is None:
                spent = self._budget_spent(draft)
            if spent:
                break
            remaining = r.num_prefill_tokens - r.num_scheduled_tokens
            smallest = grid if grid < remaining else remaining
            floor = draft.floor
            if floor is None or smallest < floor:
                blocked = (
                    long_min is not None
                    and r.num_prefill_tokens >= long_min
                    and len(long_groups) >= kvp
                )
                if not blocked and self._try_prefill(r, draft, now):
                    chosen.append(r)
                    skips = 0
                    spent = None
                    continue
                if smallest > draft.fits_somewhere:  # else it cannot become the floor
                    self._lower_floor(draft, smallest)
                    spent = None
            skips += 1
            if skips >= max_skips and entries:  # decodes are entries here
                break  # an empty batch looks on: a request that can run must not wait
        for r in chosen:
            self._queue.remove(r.request_id)
        if self._adaptive and not entries and not self._in_flight:
            self._force_progress(draft, now)

    def _force_progress(self, draft: Draft, now: float) -> None:
        """Nothing runs and no chunk fits T: the first queued request that KV memory
        allows takes one grid chunk anyway (the scheduler's liveness rule)."""
        for r in self._queue.iter_sorted(now):
            if self._try_prefill(r, draft, now, force=True):
                self._queue.remove(r.request_id)
                return

    def _budget_spent(self, draft: Draft) -> bool:
        """True when no prefill chunk at all can join the draft."""
        if not self._adaptive:
            size = self.config.chunk_size
            return size is not None and size > 0 and draft.num_tokens >= size
        if draft.cost.time >= draft.target:
            return True
        if draft.floor is None and draft.fits_somewhere < 1:
            # One token at KV 0 bounds any chunk's cost. A grid chunk is probed
            # first: when it fits, so does every candidate's smallest chunk.
            self._lower_floor(draft, self.config.token_grid)
            if draft.floor is not None:
                self._lower_floor(draft, 1)
        return draft.floor == 1

    def _lower_floor(self, draft: Draft, tokens: int) -> None:
        """Record ``tokens`` as the draft's floor if such a chunk fits on no group."""
        if not self._adaptive or (draft.floor is not None and draft.floor <= tokens):
            return
        if tokens <= draft.fits_somewhere:
            return  # a chunk at least this big fits on some group
        cost = draft.cost
        if all(
            cost.time_with([(g, tokens, 0, True)]) > draft.target for g in range(self.layout.kvp)
        ):
            draft.floor = tokens
        else:
            draft.fits_somewhere = tokens

    def _try_prefill(
        self, request: Request, draft: Draft, now: float, *, force: bool = False
    ) -> bool:
        rid = request.request_id
        admitted = rid in self._running
        # a preempted request grown past that comes back without the watermark
        reserve = 0 if request.num_prefill_tokens > self.memory.max_admit_tokens else None
        groups = (
            self.memory.groups_of(rid)
            if admitted
            else self.memory.plan_admit(request.num_prefill_tokens, reserve=reserve)
        )
        if groups is None:
            return False  # no memory for the whole prompt yet
        if self.config.adaptive:
            n, is_long = self._sizer.adaptive(request, groups, draft, now, force=force)
        else:
            n, is_long = self._sizer.fixed(request, draft), False
        if n == 0:
            return False
        if not admitted:
            ok = self.memory.admit(rid, request.num_prefill_tokens, reserve=reserve)
            assert ok and self.memory.groups_of(rid) == groups, "admission differs from its plan"
            self._running[rid] = request
            request.status = RequestStatus.RUNNING
        draft.groups[rid] = groups
        start = request.num_scheduled_tokens
        if is_long:
            draft.long_groups.update(groups[: start // self.group_limit + 1])
        draft.add(request, n, chunk_works(groups, start, n, self.group_limit))
        draft.num_prefills += 1
        return True

    def _emit(self, draft: Draft, now: float, preempted: list[str]) -> ScheduleOutput:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        chunks = []
        entries = []
        limit, pop_new_blocks = self.group_limit, self.memory.pop_new_blocks
        groups_of = draft.groups
        for r, n in draft.entries:
            rid, start = r.request_id, r.num_scheduled_tokens
            samples = start + n == r.num_prompt_tokens + len(r.output_token_ids)
            groups = groups_of[rid][: start // limit + 1]
            ids = () if r.prompt_token_ids is None else r.token_ids(start, start + n)
            chunks.append(ScheduledChunk(rid, start, n, groups, pop_new_blocks(rid), ids, samples))
            r.num_scheduled_tokens = start + n
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            entries.append((r, start, n, samples))
        if entries:
            self._in_flight[batch_id] = _InFlight(entries)
        n = self._num_decodes
        return ScheduleOutput(
            batch_id,
            now,
            tuple(chunks[n:]),
            tuple(preempted),
            draft.cost.time,
            draft.target,
            DecodeBatch.from_chunks(chunks[:n]) if n else DecodeBatch(),
        )

    # ------------------------------------------------------------ decode runs
    def plan_decode_run(self, max_steps: int) -> list[float]:
        """Predicted seconds of the next decode-only iterations, if they are certain.

        They are when no prompt waits, no batch is in flight and every running
        request fits in one batch. Returns at most ``max_steps`` times, none
        for an iteration in which a request would finish, be preempted or open
        a KVP shard; an empty list when a run cannot start now. Changes nothing.
        See :mod:`medha_sched.decode_run`.
        """
        running = self._running
        if (
            self._queue
            or self._in_flight
            or self._abort_pending
            or not running
            or len(running) > self.config.max_batch_requests
        ):
            return []
        requests = list(running.values())
        steps = decode_run_limit(requests, self.memory, max_steps)
        if steps == 0:
            return []
        kvp = self.layout.kvp
        return plan_decode_run(
            requests,
            self.memory,
            lambda: BatchCost(self.cost_model, kvp),
            self.group_limit,
            steps,
        )

    def commit_decode_run(self, starts: Sequence[float]) -> range:
        """Take the first ``len(starts)`` iterations of the planned run as done.

        ``starts`` are their issue times (non-decreasing). Every running
        request gains one token (id 0) per iteration, exactly as if each had
        been scheduled and had ended. Returns the batch ids they used.
        """
        if not starts:
            return range(0)
        if starts[0] < self._clock:
            raise SchedulerError(f"time went backwards: {starts[0]} < previous {self._clock}")
        commit_decode_run(list(self._running.values()), self.memory, len(starts))
        self._clock = starts[-1]
        first = self._next_batch_id
        self._next_batch_id += len(starts)
        return range(first, self._next_batch_id)

    # ---------------------------------------------------------------- results
    def on_stage_end(self, batch_id: int, *, stage: int = 0) -> None:
        """Batch ``batch_id`` cleared pipeline ``stage``; stage 0 frees its prefills."""
        batch = self._in_flight.get(batch_id)
        if batch is None:
            raise SchedulerError(f"unknown or finished batch id {batch_id!r}")
        if stage != 0 or batch.stage0_cleared:
            return
        batch.stage0_cleared = True
        running, aborting = RequestStatus.RUNNING, self._abort_pending
        for r, _, n, _ in batch.entries:
            r.num_stage0_tokens += n
            if r.num_scheduled_tokens >= r.num_prefill_tokens:  # not prefilling
                continue
            if r.status is running and r.request_id not in aborting:
                self._refresh_work(r)
                self._queue.push(r)

    def on_batch_end(self, batch_id: int, result: BatchResult) -> tuple[str, ...]:
        """Take a batch's results back; returns the ids of requests that finished.

        Batches leave the pipeline in the order they were scheduled.
        """
        if batch_id not in self._in_flight:
            raise SchedulerError(f"unknown or finished batch id {batch_id!r}")
        oldest = next(iter(self._in_flight))
        if batch_id != oldest:
            raise SchedulerError(
                f"batch {batch_id} ended before batch {oldest}: batches must end in order"
            )
        batch = self._in_flight[batch_id]
        self._check_result(batch, result)
        if not batch.stage0_cleared:
            self.on_stage_end(batch_id, stage=0)
        del self._in_flight[batch_id]
        finished: list[str] = []
        for r, _, n, samples in batch.entries:
            r.num_computed_tokens += n
            status = self._after_compute(r, samples, result)
            if status is not None:
                self._finish(r, status)
                finished.append(r.request_id)
        return tuple(finished)

    def _check_result(self, batch: _InFlight, result: BatchResult) -> None:
        for r, _, _, samples in batch.entries:
            if samples and r.request_id not in result.sampled_token_ids:
                raise SchedulerError(
                    f"batch result has no sampled token for request {r.request_id!r}"
                )

    def _after_compute(
        self, request: Request, samples: bool, result: BatchResult
    ) -> RequestStatus | None:
        rid = request.request_id
        if rid in self._abort_pending and not request.in_flight:
            self._abort_pending.discard(rid)
            return RequestStatus.FINISHED_ABORTED
        if not samples or request.status is not RequestStatus.RUNNING:
            return None
        request.output_token_ids.append(int(result.sampled_token_ids[rid]))
        if rid in result.stopped:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _refresh_work(self, request: Request) -> None:
        request.remaining_work = self.prefill_times.remaining_time(
            request.num_prefill_tokens, request.num_scheduled_tokens
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        self._queue.remove(rid)
        self._sizer.forget(rid)
        if rid in self._running:
            self.memory.free(rid)
            del self._running[rid]
        request.status = status
        self._requests.pop(rid, None)
