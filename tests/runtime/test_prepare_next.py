"""A decode step's batch built ahead (``ModelRunner.prepare_next``) against the batch the
step builds itself: the same tensors, the same logits bit for bit, used only for the
step it assumed; and the worker loop that builds it while it waits."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import fields

import pytest
import torch

from medha_runtime import runner as runner_mod
from medha_runtime.messages import Done, Failed, Shutdown, Step
from medha_runtime.model import ForwardBatch
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.runner import ModelRunner, RunnerSpec, build_group_batch
from medha_runtime.sampling_params import SampleSpec
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
        for p in plans:
            prepared = ahead._ahead
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
            assert ahead.prepare_next() == (nxt % BLOCK != 0)  # False: it needs a new block
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
        ]
        for other in others:
            runner._last_plan = plans[0]
            assert runner.prepare_next()
            assert runner._take_ahead(other) is None and runner._ahead is None
            assert runner.prepare_next() is False  # once per step: nothing ran since
        assert runner.steps_ahead == 0
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
    finally:
        torch.set_num_threads(n)


class _Broken:
    def execute(self, plan: StepPlan) -> list[int]:
        return [plan.step_id]

    def prepare_next(self) -> bool:
        raise ValueError("cannot build ahead")


def test_a_failure_building_ahead_fails_the_next_step() -> None:
    driver, worker = mp.Pipe(duplex=True)
    driver.send(Step(StepPlan(1, ())))
    driver.send(Step(StepPlan(2, ())))
    assert serve(_Broken(), _Idle(worker), rank=3) == 1
    first, second = driver.recv(), driver.recv()
    assert isinstance(first, Done) and first.result == [1]
    assert isinstance(second, Failed) and "cannot build ahead" in second.error
    assert "after 1" in second.error


def _kvp2(rank: int, world: int, init: str) -> tuple[list, list, int]:
    """Rank ``rank`` of two: the same steps by a runner that builds ahead and one that
    does not; (their results, the ahead runner's steps ahead)."""
    from medha_parallel import ParallelLayout, ParallelState

    torch.set_num_threads(1)
    state = ParallelState.initialize(
        ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
    )
    plans = _decode_plans("a", 21, 11, kvp=2, group_tokens=16)  # decodes 21..30 on group 1
    spec = _spec(num_blocks=8, kvp=2, group_tokens=16)
    out = []
    for ahead in (False, True):
        runner = ModelRunner(spec, state)
        got = []
        for p in plans:
            got.append(runner.execute(p))
            if ahead:
                runner.prepare_next()
        out.append(got)
    return out[0], out[1], runner.steps_ahead


@pytest.mark.parametrize("world", [2])
def test_kvp2_ranks_building_ahead_match_ranks_that_do_not(world: int) -> None:
    (plain0, ahead0, n0), (plain1, ahead1, n1) = launch(_kvp2, world)
    assert ahead0 == plain0 and plain0[-1] is not None and len(plain0[-1]) == 1
    assert ahead1 == plain1 == [None] * len(plain1)
    # 10 decodes at 21..30; group 1 (the tail) opens blocks at 24 and 28 (local 8 and 12),
    # group 0 none (its new blocks are group 1's)
    assert (n0, n1) == (10, 8)
