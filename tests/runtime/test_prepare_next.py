"""A decode step's batch built ahead (``ModelRunner.prepare_next``) against the batch the
step builds itself: the same tensors, the same logits bit for bit, used only for the
step it assumed; and the worker loop that builds it while it waits."""

from __future__ import annotations

import logging
import multiprocessing as mp
from dataclasses import fields

import pytest
import torch

from medha_runtime import runner as runner_mod
from medha_runtime.messages import Done, Shutdown, Step
from medha_runtime.model import ForwardBatch
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.runner import ModelRunner, RunnerSpec, build_group_batch
from medha_runtime.sampling_params import PromptLogprobSpec, SampleSpec
from medha_runtime.transport import PipeTransport
from medha_runtime.worker import serve
from tests.parallel.dist import launch

BLOCK = 4
GREEDY = SampleSpec("a", 0.0, 0, 1.0, 0, None)


def _decode_plans(
    rid: str, prompt: int, new: int, *, kvp: int = 1, group_tokens: int = 0, first_block: int = 0
) -> list[StepPlan]:
    """A ``prompt``-token prefill (one chunk per KVP shard) then ``new - 1`` decodes of
    request ``rid``, with the blocks a scheduler would hand out (ids from
    ``first_block`` up on each group, in order); tokens are fixed, not sampled."""
    g = group_tokens if kvp > 1 else 1 << 30
    held: dict[int, int] = {}  # blocks per group

    def chunk(start: int, tokens: tuple[int, ...], sample: SampleSpec | None) -> PlannedChunk:
        shard = start // g
        group = shard  # shard i on group i
        local_end = start + len(tokens) - shard * g
        need = -(-local_end // BLOCK)
        have = held.get(group, 0)
        new_blocks = ()
        if need > have:
            new_blocks = ((group, tuple(range(first_block + have, first_block + need))),)
            held[group] = need
        return PlannedChunk(rid, start, tokens, tuple(range(shard + 1)), new_blocks, sample)

    plans, step, pos = [], 0, 0
    while pos < prompt:
        end = min(prompt, (pos // g + 1) * g)
        last = end == prompt
        tokens = tuple((3 * p + 1) % 250 for p in range(pos, end))
        plans.append(StepPlan(step, (chunk(pos, tokens, GREEDY if last else None),)))
        step, pos = step + 1, end
    for _ in range(new - 1):
        plans.append(StepPlan(step, (chunk(pos, ((7 * pos) % 250,), GREEDY),)))
        step, pos = step + 1, pos + 1
    return plans


def _spec(**kw) -> RunnerSpec:
    return RunnerSpec(model="tiny", dtype="float32", device="cpu", block_size=BLOCK, **kw)


def _assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    for f in fields(ForwardBatch):
        if not f.init:
            continue
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name
    assert got._kv_write is not None and want._kv_write is not None  # from the host list
    assert torch.equal(got._kv_write[0], want._kv_write[0])
    assert got._kv_write[1] is None and want._kv_write[1] is None


def _logits(monkeypatch) -> list[torch.Tensor]:
    """Every sampled step's logits, as the sampler gets them."""
    seen: list[torch.Tensor] = []
    sample_step = runner_mod.sample_step

    def keep(sampler, logits, chunks):
        seen.append(logits.clone())
        return sample_step(sampler, logits, chunks)

    monkeypatch.setattr(runner_mod, "sample_step", keep)
    return seen


def test_a_batch_built_ahead_is_the_steps_own_and_gives_the_same_logits(monkeypatch) -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plans = _decode_plans("a", 9, 24)  # decodes at 9..31: 5 of them open a new block
        logits = _logits(monkeypatch)
        plain = ModelRunner(_spec(num_blocks=16))
        want = [plain.execute(p) for p in plans]
        want_logits, logits[:] = list(logits), []
        ahead = ModelRunner(_spec(num_blocks=16))
        got, built = [], 0
        for i, p in enumerate(plans):
            prepared = ahead._ahead
            if prepared is not None:  # built after an even step: its stop said a step waits
                assert len(prepared[1]._plans) == 1 - i % 2  # so no attention plan yet
            got.append(ahead.execute(p))
            if prepared is not None and ahead.steps_ahead > built:  # this step took it
                built = ahead.steps_ahead
                fresh, _ = build_group_batch(
                    p,
                    ahead.tables,
                    group=0,
                    kvp=1,
                    group_tokens=0,
                    block_size=BLOCK,
                    device="cpu",
                    capacity=ahead._kv_slots,
                )
                _assert_same_batch(prepared[1], fresh)
            nxt = p.chunks[0].start + len(p.chunks[0].token_ids)
            stop = i % 2 == 0  # after an even step the attention plan is left to the step
            built_now = ahead.prepare_next(stop=lambda stop=stop: stop)
            assert built_now == (nxt % BLOCK != 0)  # False: it needs a new block
        assert got == want
        assert len(logits) == len(want_logits) == 24
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
        # every decode but the 5 that open a block (9 is a prefill's, 12, 16, ... new blocks)
        assert ahead.steps_ahead == 23 - 5
        assert plain.steps_ahead == 0
    finally:
        torch.set_num_threads(n)


def test_a_batch_built_ahead_is_dropped_for_any_other_step() -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plans = _decode_plans("a", 5, 3)  # prefill 0..4, decodes at 5 and 6
        runner = ModelRunner(_spec(num_blocks=16))
        runner.execute(plans[0])
        decode = plans[1]
        c = decode.chunks[0]
        others = [
            StepPlan(1, (c._replace(start=c.start + 1),)),  # not the next position
            StepPlan(1, (c, PlannedChunk("b", 0, (5, 6), (0,), ((0, (9,)),), GREEDY))),
            StepPlan(1, (c._replace(sample=GREEDY._replace(temperature=1.0)),)),
            StepPlan(1, (c._replace(new_blocks=((0, (8,)),)),)),  # a block for this group
            StepPlan(1, (c,), free=("z",)),
            StepPlan(1, (c,), finished=("z",)),
            # another request at the same start, sampled alike: only its id differs
            StepPlan(1, (c._replace(request_id="b"),)),
            StepPlan(1, (c._replace(token_ids=(c.token_ids[0], 9)),)),  # two tokens
            StepPlan(1, (c._replace(kvp_groups=(0, 1)),)),
            StepPlan(1, (c._replace(prompt_logprobs=PromptLogprobSpec(2, ())),)),
        ]
        for other in others:
            runner._ahead_misses = runner._ahead_skip = 0  # no back-off between the cases
            runner._last_plan = plans[0]
            assert runner.prepare_next()
            assert runner._take_ahead(other) is None and runner._ahead is None
            assert runner.prepare_next() is False  # once per step: nothing ran since
        assert runner.steps_ahead == 0
        runner._ahead_misses = runner._ahead_skip = 0
        runner._last_plan = plans[0]
        assert runner.prepare_next()
        runner.execute(decode)
        assert runner.steps_ahead == 1
        # a prefill chunk that samples nothing, or a step of synthetic requests: nothing ahead
        assert not ModelRunner(_spec(num_blocks=16)).prepare_next()
        mid = ModelRunner(_spec(num_blocks=16))
        mid.execute(StepPlan(0, (plans[0].chunks[0]._replace(sample=None),)))
        assert not mid.prepare_next()
        synthetic = ModelRunner(_spec(num_blocks=16))
        synthetic.execute(StepPlan(0, plans[0].chunks, release_after=("a",)))
        assert not synthetic.prepare_next()
    finally:
        torch.set_num_threads(n)


def _two_requests(sample_b: SampleSpec) -> tuple[ModelRunner, StepPlan, StepPlan]:
    """A runner that ran the 5-token prefills of ``a`` and ``b`` (blocks 0-1 and 2-3);
    (it, that step, the step of their decodes at 5)."""
    runner = ModelRunner(_spec(num_blocks=16))
    pa = PlannedChunk("a", 0, (1, 2, 3, 4, 5), (0,), ((0, (0, 1)),), GREEDY)
    pb = PlannedChunk("b", 0, (6, 7, 8, 9, 10), (0,), ((0, (2, 3)),), sample_b)
    prefill = StepPlan(0, (pa, pb))
    runner.execute(prefill)
    decode = StepPlan(
        1,
        (
            pa._replace(start=5, token_ids=(11,), new_blocks=()),
            pb._replace(start=5, token_ids=(12,), new_blocks=()),
        ),
    )
    return runner, prefill, decode


@pytest.mark.parametrize("shared", [False, True])
def test_a_batch_built_ahead_is_dropped_for_its_requests_swapped(shared: bool) -> None:
    """Two requests' decodes at the same position, in the other order: dropped, whether
    their sampling differs (as each request's own spec does) or not (only the ids tell
    the rows apart)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner, prefill, decode = _two_requests(
            GREEDY if shared else GREEDY._replace(request_id="b")
        )
        swapped = StepPlan(1, decode.chunks[::-1])
        runner._last_plan = prefill
        assert runner.prepare_next()
        assert runner._take_ahead(swapped) is None and runner.steps_ahead == 0
        runner._last_plan = prefill
        assert runner.prepare_next()
        assert runner._take_ahead(decode) is not None and runner.steps_ahead == 1
    finally:
        torch.set_num_threads(n)


def test_a_step_ending_in_a_prefill_chunk_stops_at_once() -> None:
    """The engine puts prefill chunks after the decodes: prepare_next looks at the last
    chunk first and reads no block table for the decodes before it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner, _, decode = _two_requests(GREEDY._replace(request_id="b"))
        reads = []
        blocks = runner.tables.blocks

        def counted(rid: str, group: int):
            reads.append(rid)
            return blocks(rid, group)

        runner.tables.blocks = counted  # type: ignore[method-assign]
        chunk = PlannedChunk("c", 0, (3, 4, 5, 6), (0,), ((0, (4,)),), None)
        runner._last_plan = StepPlan(1, (*decode.chunks, chunk))
        assert not runner.prepare_next() and reads == []
        # the last chunk asks for prompt logprobs: the same
        logprobs = chunk._replace(sample=GREEDY, prompt_logprobs=PromptLogprobSpec(1, (5,)))
        runner._last_plan = StepPlan(1, (*decode.chunks, logprobs))
        assert not runner.prepare_next() and reads == []
        runner._last_plan = decode  # decodes only: each request's table is read
        assert runner.prepare_next() and reads[:2] == ["a", "b"]
    finally:
        torch.set_num_threads(n)


def test_builds_back_off_after_misses_in_a_row() -> None:
    """From the second unused build in a row the next 2, 4, 8, then 16 builds are
    skipped (16 at most); a used build ends the back-off."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plans = _decode_plans("a", 5, 3)
        runner = ModelRunner(_spec(num_blocks=16))
        runner.execute(plans[0])
        decode = plans[1]
        other = StepPlan(1, decode.chunks, finished=("z",))  # any step it did not assume

        def run(steps: int, nxt: StepPlan) -> list[bool]:
            built = []
            for _ in range(steps):
                runner._last_plan = plans[0]
                built.append(runner.prepare_next())
                if built[-1]:
                    runner._take_ahead(nxt)
            return built

        want = [True, True] + [False] * 2 + [True] + [False] * 4 + [True] + [False] * 8
        want += [True] + [False] * 16 + [True] + [False] * 16 + [True]
        assert run(len(want), other) == want
        assert runner._ahead_misses == 7 and runner.steps_ahead == 0
        assert run(17, other)[-1]  # 16 skipped after the 7th miss; the 8th skips 16 more
        assert run(16, other) == [False] * 16
        assert run(1, decode) == [True] and runner.steps_ahead == 1  # used: back-off ends
        assert runner._ahead_misses == 0 and runner._ahead_skip == 0
        # a single miss after it skips nothing
        assert run(3, other) == [True, True, False]
    finally:
        torch.set_num_threads(n)


class _Idle(PipeTransport):
    """A pipe whose driver is always still turning the step around (nothing pending)."""

    def pending(self) -> bool:
        return False


def test_the_worker_loop_builds_the_next_batch_while_it_waits() -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plans = _decode_plans("a", 6, 12)
        plain = ModelRunner(_spec(num_blocks=16))
        want = [plain.execute(p) for p in plans]
        driver, worker = mp.Pipe(duplex=True)
        for p in plans:
            driver.send(Step(p))
        driver.send(Shutdown())
        runner = ModelRunner(_spec(num_blocks=16))
        assert serve(runner, _Idle(worker), rank=0) == 0
        done = [driver.recv() for _ in plans]
        assert all(isinstance(d, Done) for d in done)
        assert [d.result for d in done] == want
        assert runner.steps_ahead == 11 - 3  # decodes at 6..16; 8, 12 and 16 open a block
        # messages already waiting: nothing is built ahead
        for p in plans:
            driver.send(Step(p))
        driver.send(Shutdown())
        busy = ModelRunner(_spec(num_blocks=16))
        assert serve(busy, PipeTransport(worker), rank=0) == 0
        assert [driver.recv().result for _ in plans] == want
        assert busy.steps_ahead == 0
        # a step arrives while the batch is built: the worker's stop leaves the
        # attention plan to the step, which still runs the batch built ahead
        for ahead_transport, with_plan in ((_Idle, 1), (_StepArrivesDuringBuild, 0)):
            for p in plans:
                driver.send(Step(p))
            driver.send(Shutdown())
            recording = _Recording(_spec(num_blocks=16))
            assert serve(recording, ahead_transport(worker), rank=0) == 0
            assert [driver.recv().result for _ in plans] == want
            assert recording.steps_ahead == 8
            assert recording.plans_built == [with_plan] * 9  # the last one after the last step
    finally:
        torch.set_num_threads(n)


class _StepArrivesDuringBuild(PipeTransport):
    """A pipe with nothing pending when the worker looks after its reply, and a step
    pending when it is asked again (the build's ``stop``)."""

    def send(self, msg) -> None:
        self.asks = 0
        super().send(msg)

    def pending(self) -> bool:
        self.asks += 1
        return self.asks > 1


class _Recording(ModelRunner):
    """A runner that records, per batch built ahead, how many attention plans it holds."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.plans_built: list[int] = []

    def prepare_next(self, stop=None) -> bool:
        built = super().prepare_next(stop=stop)
        if built:
            assert self._ahead is not None
            self.plans_built.append(len(self._ahead[1]._plans))
        return built


class _FailsAhead(ModelRunner):
    """A runner whose build ahead raises midway (after the batch, before the plan)."""

    calls = 0

    def prepare_next(self, stop=None) -> bool:
        self.calls += 1

        def boom() -> bool:
            raise ValueError("cannot build ahead")

        return super().prepare_next(stop=boom)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_failure_building_ahead_is_logged_once_and_the_steps_go_on() -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    log = logging.getLogger("medha_runtime.worker")
    records = _Records()
    log.addHandler(records)
    try:
        plans = _decode_plans("a", 6, 8)
        plain = ModelRunner(_spec(num_blocks=16))
        want = [plain.execute(p) for p in plans]
        driver, worker = mp.Pipe(duplex=True)
        for p in plans:
            driver.send(Step(p))
        driver.send(Shutdown())
        runner = _FailsAhead(_spec(num_blocks=16))
        assert serve(runner, _Idle(worker), rank=3) == 0
        done = [driver.recv() for _ in plans]
        assert all(isinstance(d, Done) for d in done)
        assert [d.result for d in done] == want
        # tried after the first step only: nothing built, nothing used
        assert runner.calls == 1 and runner.steps_ahead == 0 and runner._ahead is None
        assert len(records.records) == 1
        rec = records.records[0]
        assert rec.levelno == logging.WARNING and "rank 3" in rec.getMessage()
        assert "after 0" in rec.getMessage()
        assert rec.exc_info is not None and "cannot build ahead" in str(rec.exc_info[1])
    finally:
        log.removeHandler(records)
        torch.set_num_threads(n)


def _kvp2(rank: int, world: int, init: str) -> dict[str, object]:
    """Rank ``rank`` of two: the same steps by a runner that builds ahead and one that
    does not, for decodes on one shard and for decodes that cross into the next:
    their results, the ahead runner's steps ahead and what each prepare_next returned."""
    from medha_parallel import ParallelLayout, ParallelState

    torch.set_num_threads(1)
    state = ParallelState.initialize(
        ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
    )
    spec = _spec(num_blocks=8, kvp=2, group_tokens=16)
    out: dict[str, object] = {}
    for name, plans in (
        ("tail", _decode_plans("a", 21, 11, kvp=2, group_tokens=16)),  # decodes 21..30, group 1
        ("cross", _decode_plans("a", 13, 8, kvp=2, group_tokens=16)),  # decodes 13..19
    ):
        for ahead in (False, True):
            runner = ModelRunner(spec, state)
            got, built = [], []
            for p in plans:
                got.append(runner.execute(p))
                if ahead:
                    built.append(runner.prepare_next())
            out[f"{name}_{'ahead' if ahead else 'plain'}"] = got
        out[f"{name}_n"], out[f"{name}_built"] = runner.steps_ahead, built
    return out


@pytest.mark.parametrize("world", [2])
def test_kvp2_ranks_building_ahead_match_ranks_that_do_not(world: int) -> None:
    r0, r1 = launch(_kvp2, world)
    plain0 = r0["tail_plain"]
    assert r0["tail_ahead"] == plain0 and plain0[-1] is not None and len(plain0[-1]) == 1
    assert r1["tail_ahead"] == r1["tail_plain"] == [None] * len(plain0)
    # 10 decodes at 21..30; group 1 (the tail) opens blocks at 24 and 28 (local 8 and 12),
    # group 0 none (its new blocks are group 1's)
    assert (r0["tail_n"], r1["tail_n"]) == (10, 8)
    # decodes 13..19 cross into shard 1 at 16: no rank builds the step of 16 (group 1
    # holds no block of it yet, group 0 would write past its shard); the rest are built
    plain0 = r0["cross_plain"]
    assert r0["cross_ahead"] == plain0 and all(p is not None and len(p) == 1 for p in plain0)
    assert r1["cross_ahead"] == r1["cross_plain"] == [None] * 8
    # after the prefill and the decodes at 13, 14, 15 (-> 16: new shard), 16, 17, 18, 19
    # (-> 20: group 1 opens its second block)
    built = [True, True, True, False, True, True, True]
    assert r0["cross_built"] == [*built, True] and r1["cross_built"] == [*built, False]
    assert r0["cross_n"] == r1["cross_n"] == 6
