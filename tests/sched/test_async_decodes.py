"""``SchedulerConfig.async_decodes``: a running request's next decode issued one ahead.

The driver below works like the in-process engine with async scheduling: it
forms a batch, says at once that it cleared stage 0, forms the next one, and
only then ends the oldest (at most two in flight). Tokens are a function of
(request, position), so a token lost, duplicated or put in the wrong place
shows up in the requests' outputs. Requests stop (EOS / stop strings) and
are aborted at random points.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha_sched import PENDING_TOKEN, BatchResult, Request, Scheduler, SchedulerConfig
from medha_sched.config import CacheConfig
from medha_sched.cost import AffineCostModel
from medha_sched.output import ScheduleOutput
from medha_sched.request import RequestStatus

from .strategies import setups

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def token_at(request_id: str, position: int) -> int:
    """The token at ``position`` of a request's output (a pure function)."""
    return (hash((request_id, position)) & 0xFFF) + 1


def prompt_of(request_id: str, n: int) -> list[int]:
    return [(hash((request_id, "p", i)) & 0xFF) + 1 for i in range(n)]


@dataclasses.dataclass
class Run:
    outputs: list[ScheduleOutput] = dataclasses.field(default_factory=list)
    finished: dict[str, Request] = dataclasses.field(default_factory=dict)
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # rid -> rows dropped
    ahead: int = 0  # decode chunks issued with PENDING_TOKEN
    max_in_flight: int = 0
    calls: list[ScheduleOutput] = dataclasses.field(default_factory=list)  # empty ones too
    first_decode_due: dict[str, int] = dataclasses.field(default_factory=dict)  # rid -> call


def drive(
    sched: Scheduler,
    requests: list[Request],
    *,
    stop_after: dict[str, int],
    abort_at: dict[str, int],
    max_iters: int = 20_000,
) -> Run:
    """Run to completion as the async engine does, checking every batch.

    ``stop_after[rid]``: the request stops (EOS) once it holds that many
    output tokens; ``abort_at[rid]``: it is aborted before that iteration.
    """
    run = Run()
    pending = sorted(requests, key=lambda r: r.arrival_time)
    by_id = {r.request_id: r for r in requests}
    prompts = {r.request_id: r.prompt_token_ids for r in requests}
    in_flight: deque[ScheduleOutput] = deque()
    issued_after: dict[str, int] = {}  # finished rid -> batches formed when it finished
    accepted: dict[str, int] = {}  # rid -> output tokens the driver accepted
    computed: dict[str, tuple[int, int]] = {}  # rid -> (preemptions, computed tokens)
    now, iters = 0.0, 0

    def check_chunk(out: ScheduleOutput, c) -> None:
        rid = c.request_id
        assert rid not in run.finished, f"finished request {rid} scheduled again"
        r = by_id[rid]
        p = len(prompts[rid])
        for k, tok in enumerate(c.token_ids):
            pos = c.start + k
            if tok == PENDING_TOKEN:
                # only a decode, issued while the batch sampling its token is in flight
                assert c.num_tokens == 1 and c.samples
                assert pos == r.num_prompt_tokens + len(r.output_token_ids)
                run.ahead += 1
                continue
            want = prompts[rid][pos] if pos < p else token_at(rid, pos)
            assert tok == want, f"{rid}: token {tok} at {pos}, expected {want}"

    def end_oldest() -> None:
        out = in_flight.popleft()
        tokens: dict[str, int] = {}
        stopped: set[str] = set()
        for c in out.chunks:
            if not c.samples:
                continue
            rid = c.request_id
            if rid in run.finished:
                # the one decode issued ahead of its request's finish: dropped
                assert out.batch_id < issued_after[rid], f"{rid} scheduled after it finished"
                # max_output_tokens is known ahead: only a stop or an abort drops one
                assert run.finished[rid].status is not RequestStatus.FINISHED_LENGTH
                run.dropped[rid] = run.dropped.get(rid, 0) + 1
                assert run.dropped[rid] == 1, f"{rid}: more than one chunk after its finish"
                continue
            pos = c.start + c.num_tokens
            tokens[rid] = token_at(rid, pos)
            if pos == len(prompts[rid]):  # its prefill ends here: a decode may follow
                run.first_decode_due.setdefault(rid, len(run.calls))
            accepted[rid] = accepted.get(rid, 0) + 1
            if stop_after.get(rid) == pos - len(prompts[rid]) + 1:
                stopped.add(rid)
        done = sched.on_batch_end(out.batch_id, BatchResult(tokens, frozenset(stopped)))
        for rid in done:
            run.finished[rid] = by_id[rid]
            issued_after[rid] = sched._next_batch_id
        for rid in stopped:
            assert rid in done, f"stopped request {rid} did not finish"

    while pending or sched.has_unfinished_requests():
        iters += 1
        assert iters <= max_iters, "no progress: liveness violated"
        while pending and pending[0].arrival_time <= now:
            sched.add_request(pending.pop(0))
        for rid, at in abort_at.items():
            if at == iters and sched.get_request(rid) is not None:
                sched.abort_request(rid)
                if sched.get_request(rid) is None:
                    run.finished[rid] = by_id[rid]
                    issued_after[rid] = sched._next_batch_id
        formed = False
        if len(in_flight) < 2:
            out = sched.schedule(now)
            run.calls.append(out)
            if not out.is_empty:
                for c in out.chunks:
                    check_chunk(out, c)
                run.outputs.append(out)
                in_flight.append(out)
                sched.on_stage_end(out.batch_id)
                formed = True
                run.max_in_flight = max(run.max_in_flight, len(in_flight))
        sched.memory.check_invariants()
        for r in sched._requests.values():
            # at most one decode ahead: the newest token plus one in flight
            assert r.num_scheduled_tokens <= r.num_tokens + 1
            assert r.num_computed_tokens <= r.num_scheduled_tokens
            before = computed.get(r.request_id)
            if before is not None and before[0] == r.num_preemptions:
                assert r.num_computed_tokens >= before[1], "progress went backwards"
            computed[r.request_id] = (r.num_preemptions, r.num_computed_tokens)
        if in_flight and (not formed or len(in_flight) >= 2):
            end_oldest()
        now += 1e-3
    for rid, r in run.finished.items():
        outs = r.output_token_ids
        p = r.num_prompt_tokens
        assert outs == [token_at(rid, p + i) for i in range(len(outs))], f"{rid}: tokens"
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert len(outs) == r.max_output_tokens
        elif r.status is RequestStatus.FINISHED_STOPPED:
            assert len(outs) == stop_after[rid]
        else:
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert len(outs) <= accepted.get(rid, 0)
    assert sched.memory.usage() == 0.0
    sched.memory.check_invariants()
    return run


def async_twin(sched: Scheduler) -> Scheduler:
    config = dataclasses.replace(sched.config, async_decodes=True)
    return Scheduler(config, sched.cost_model, cache=sched.cache)


@st.composite
def token_workloads(draw, sched: Scheduler):
    """Requests with token ids; a random subset stops early or is aborted."""
    n = draw(st.integers(1, 10))
    cap = max(1, min(sched.max_prompt_tokens, 600))
    requests, stop_after, abort_at = [], {}, {}
    for i in range(n):
        prompt = draw(st.integers(1, cap))
        output = draw(st.integers(1, 48))
        if prompt + output > sched.max_context_tokens:
            continue
        rid = f"r{i}"
        arrival = draw(st.floats(0.0, 0.05))
        requests.append(
            Request.from_tokens(rid, arrival, prompt_of(rid, prompt), max_output_tokens=output)
        )
        kind = draw(st.sampled_from(["run", "run", "stop", "abort"]))
        if kind == "stop":
            stop_after[rid] = draw(st.integers(1, output))
        elif kind == "abort":
            abort_at[rid] = draw(st.integers(1, 80))
    return requests, stop_after, abort_at


@SETTINGS
@given(data=st.data())
def test_async_decodes_keep_the_invariants(data) -> None:
    sched = async_twin(data.draw(setups()))
    requests, stop_after, abort_at = data.draw(token_workloads(sched))
    run = drive(sched, requests, stop_after=stop_after, abort_at=abort_at)
    assert set(run.finished) == {r.request_id for r in requests}
    assert run.max_in_flight <= 2


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_async_decodes_under_tight_memory(data) -> None:
    sched = async_twin(data.draw(setups(adaptive=True, tight_memory=True)))
    requests, stop_after, abort_at = data.draw(token_workloads(sched))
    run = drive(sched, requests, stop_after=stop_after, abort_at=abort_at)
    assert set(run.finished) == {r.request_id for r in requests}


def plain_scheduler(*, async_decodes: bool, max_batch_requests: int = 64) -> Scheduler:
    config = SchedulerConfig(
        policy="fcfs", async_decodes=async_decodes, max_batch_requests=max_batch_requests
    )
    model = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
    return Scheduler(config, model, cache=CacheConfig(block_size=4, num_blocks_per_group=256))


def test_steady_decodes_go_one_ahead_and_stop_at_max_tokens() -> None:
    """Four decodes of different lengths: after the first decode every batch is
    issued ahead (PENDING_TOKEN), except when one of them reaches max tokens."""
    sched = plain_scheduler(async_decodes=True)
    lengths = {"a": 12, "b": 20, "c": 20, "d": 7}
    reqs = [
        Request.from_tokens(rid, 0.0, prompt_of(rid, 5), max_output_tokens=n)
        for rid, n in lengths.items()
    ]
    run = drive(sched, reqs, stop_after={}, abort_at={})
    assert {rid: len(r.output_token_ids) for rid, r in run.finished.items()} == lengths
    assert run.max_in_flight == 2
    assert run.ahead > 0
    assert not run.dropped  # max tokens is known ahead: nothing is issued past it
    for out in run.outputs:
        for c in out.chunks:
            if c.token_ids == (PENDING_TOKEN,):
                r = run.finished[c.request_id]
                assert c.start < r.num_prompt_tokens + r.max_output_tokens - 1


def test_a_stop_drops_the_decode_issued_ahead() -> None:
    sched = plain_scheduler(async_decodes=True)
    reqs = [Request.from_tokens(rid, 0.0, prompt_of(rid, 6), max_output_tokens=30) for rid in "xy"]
    run = drive(sched, reqs, stop_after={"x": 4}, abort_at={})
    assert run.finished["x"].output_token_ids == [token_at("x", 6 + i) for i in range(4)]
    assert run.finished["x"].status is RequestStatus.FINISHED_STOPPED
    assert run.dropped == {"x": 1}
    assert len(run.finished["y"].output_token_ids) == 30


def test_mode_off_issues_nothing_ahead() -> None:
    sched = plain_scheduler(async_decodes=False)
    reqs = [Request.from_tokens(rid, 0.0, prompt_of(rid, 6), max_output_tokens=9) for rid in "xy"]
    run = drive(sched, reqs, stop_after={}, abort_at={})
    assert run.ahead == 0
    assert run.max_in_flight == 1
    assert all(len(r.output_token_ids) == 9 for r in run.finished.values())


def test_async_decodes_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="async_decodes must be True or False, got 'yes'"):
        SchedulerConfig(async_decodes="yes")  # type: ignore[arg-type]


def test_a_request_whose_prefill_ends_joins_the_decodes_in_flight() -> None:
    """A prefill ending while the running decodes have a batch in flight: its first
    decode is in the very next batch (it joins their lane), and theirs go on."""
    sched = plain_scheduler(async_decodes=True)
    reqs = [
        Request.from_tokens("a", 0.0, prompt_of("a", 5), max_output_tokens=40),
        Request.from_tokens("b", 0.01, prompt_of("b", 9), max_output_tokens=6),
        Request.from_tokens("c", 0.02, prompt_of("c", 3), max_output_tokens=1),
    ]
    run = drive(sched, reqs, stop_after={}, abort_at={})
    assert {rid: len(r.output_token_ids) for rid, r in run.finished.items()} == {
        "a": 40,
        "b": 6,
        "c": 1,
    }
    due = run.first_decode_due["b"]
    assert "b" in {c.request_id for c in run.calls[due].chunks}
    # a's decodes: one in every call from its first decode's to its last one's
    with_a = [
        i
        for i, out in enumerate(run.calls)
        if any(c.request_id == "a" and c.samples and c.start >= 5 for c in out.chunks)
    ]
    assert len(with_a) == 39 and with_a == list(range(with_a[0], with_a[0] + 39))


class _Stepper:
    """Forms batches as the async engine does (stage 0 cleared at once, at most
    two in flight) and ends the oldest with token 7 for every sampled row."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.flying, self.now = sched, deque(), 0.0

    def form(self) -> ScheduleOutput | None:
        out = self.sched.schedule(self.now)
        self.now += 1e-3
        if out.is_empty:
            return None
        self.sched.on_stage_end(out.batch_id)
        self.flying.append(out)
        return out

    def end(self) -> tuple[str, ...]:
        out = self.flying.popleft()
        tokens = {c.request_id: 7 for c in out.chunks if c.samples}
        return self.sched.on_batch_end(out.batch_id, BatchResult(tokens, frozenset()))


@pytest.mark.parametrize("async_", [False, True])
def test_decodes_held_back_keep_their_places_from_prefills(async_: bool) -> None:
    """``max_batch_requests`` bounds the running requests as without async: a
    batch that holds its decodes back for the one in flight (or whose requests'
    sampling chunks are in flight) must not fill their places with prefills."""
    sched = plain_scheduler(async_decodes=async_, max_batch_requests=3)
    for i in range(12):
        sched.add_request(
            Request.from_tokens(f"r{i}", 0.0, [5] * (3 + i % 5), max_output_tokens=4 + i % 3)
        )
    stepper, most, formed = _Stepper(sched), 0, 0
    while sched.has_unfinished_requests():
        out = stepper.form()
        formed += out is not None
        most = max(most, sched.num_running)
        if out is None or len(stepper.flying) >= 2 or not async_:
            stepper.end()
        assert formed < 1000
    assert most == 3


def test_a_fresh_member_aborted_with_two_batches_in_flight_counts_what_it_computed() -> None:
    """A request whose prefill ended while its lane's next batch was in flight
    joins it fresh; aborted after its first decode is issued, it finishes at the
    end of a batch that does not hold that decode, with only its prompt computed."""
    sched = plain_scheduler(async_decodes=True)
    a = Request.from_tokens("a", 0.0, [1, 2, 3, 4, 5], max_output_tokens=40)
    sched.add_request(a)
    stepper = _Stepper(sched)
    for _ in range(6):  # a decodes, one batch ahead
        out = stepper.form()
        if out is None or len(stepper.flying) >= 2:
            stepper.end()
    b = Request.from_tokens("b", stepper.now, [9, 9, 9], max_output_tokens=30)
    sched.add_request(b)
    aborted_at = None
    for _ in range(8):
        out = stepper.form()
        if out is not None and any(c.request_id == "b" and c.start == 3 for c in out.chunks):
            aborted_at = (b.num_scheduled_tokens, b.num_computed_tokens)
            sched.abort_request("b")
            break
        if out is None or len(stepper.flying) >= 2:
            stepper.end()
    assert aborted_at == (4, 3)  # its first decode (position 3) is in flight, not computed
    while stepper.flying:
        stepper.end()
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert b.num_computed_tokens == 3  # the prompt; its decode in flight was dropped


def test_a_request_grown_past_what_memory_admits_is_not_the_victim() -> None:
    """Found by the property above (seed 153500584178046473857599844566065558742):
    a shard takes a whole group (``max_tokens_per_group`` = its blocks), so with the
    watermark a prefill of at most (53 - 1) * 4 = 208 tokens can be admitted. r2's
    202-token prompt was; preempted at 221 tokens, it could never come back and
    the scheduler idled forever. A request that long is no victim while another is."""
    from medha_sched.config import ParallelDegrees

    from .models import PolyCostModel

    layout = ParallelDegrees(kvp=2)
    model = PolyCostModel(
        base=0.0013105300185748616, a=6.94542965188821e-05, b=6.103515625e-13,
        c=3.845877279801152e-08, d=2.1057273131741245e-10, e=5.328837338541671e-07,
        layout=layout,
    )  # fmt: skip
    config = SchedulerConfig(
        policy="srpt", target_batch_time=0.044145034646661196, chunk_size=None,
        token_grid=32, max_chunk_tokens=256, max_batch_requests=35,
        long_prefill_threshold=128, min_deadline=0.09729665817559453, async_decodes=True,
    )  # fmt: skip
    cache = CacheConfig(
        block_size=4, num_blocks_per_group=53, max_tokens_per_group=212, watermark=0.01
    )
    sched = Scheduler(config, model, cache=cache)
    assert sched.max_admit_tokens == 208
    shapes = [("r0", 0.0, 207, 3), ("r1", 0.01, 11, 12), ("r2", 0.0, 202, 41),
              ("r3", 0.0415613, 43, 45), ("r4", 0.0, 165, 42), ("r5", 0.05, 134, 36)]  # fmt: skip
    requests = [
        Request.from_tokens(rid, at, prompt_of(rid, p), max_output_tokens=out)
        for rid, at, p, out in shapes
    ]
    run = drive(sched, requests, stop_after={"r2": 26}, abort_at={"r5": 14}, max_iters=2000)
    assert set(run.finished) == {r.request_id for r in requests}


def test_a_preempted_request_past_the_watermark_limit_comes_back() -> None:
    """Also found by the property above: here every candidate victim has grown past
    (52 - 1) * 4 = 204 tokens, so r4 or r5 is preempted anyway; it is admitted
    again without the watermark (it waited forever for room the watermark never gave)."""
    from medha_sched.config import ParallelDegrees

    from .models import PolyCostModel

    model = PolyCostModel(
        base=0.0013105300185748616, a=0.0, b=0.0, c=0.0, d=0.0, e=0.0,
        layout=ParallelDegrees(kvp=2),
    )  # fmt: skip
    config = SchedulerConfig(
        policy="fcfs", target_batch_time=0.09729665817559453, chunk_size=None,
        token_grid=1, max_chunk_tokens=64, max_batch_requests=2,
        long_prefill_threshold=128, min_deadline=0.044145034646661196, async_decodes=True,
    )  # fmt: skip
    cache = CacheConfig(
        block_size=4, num_blocks_per_group=52, max_tokens_per_group=208, watermark=0.01
    )
    sched = Scheduler(config, model, cache=cache)
    assert sched.max_admit_tokens == 204
    shapes = [("r0", 1, 1), ("r1", 1, 1), ("r2", 1, 1), ("r3", 1, 2), ("r4", 203, 12),
              ("r5", 196, 10)]  # fmt: skip
    requests = [
        Request.from_tokens(rid, 0.0, prompt_of(rid, p), max_output_tokens=out)
        for rid, p, out in shapes
    ]
    run = drive(sched, requests, stop_after={}, abort_at={}, max_iters=2000)
    assert set(run.finished) == {r.request_id for r in requests}
    assert sched.num_preemptions > 0  # the case: a victim past 204 tokens
