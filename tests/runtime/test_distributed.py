"""Workers on gloo: TP2, SPP2, KVP2 and TP2 x KVP2 give one process's greedy tokens;
shutdown stops the workers; a dead worker is an error in the driver, not a hang.

Each test is one launch (one worker process per rank) of the tiny model.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from medha_runtime import LLM, SamplingParams
from medha_runtime.executor import MultiprocExecutor, StageCleared, StepDone, WorkerError
from medha_runtime.plan import BlockTables, PlannedChunk, StepPlan
from medha_runtime.runner import build_group_batch, stage_layers
from medha_sched import AffineCostModel
from medha_sched.cost.online import OnlineCostModel

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
# KVP runs use 32-token shards: prompt + output spans two groups, and the
# shorter prompts cross the shard boundary while decoding.
PROMPTS = ["Medha shards the KV cache of long prompts", "Hi", "The sky over the port was"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
#: gloo ranks on the CPU on any machine (a CUDA machine would want one GPU per rank)
COMMON = {
    "cost_model": COST,
    "policy": "fcfs",
    "chunk_size": 16,
    "kv_cache_tokens": 1024,
    "device": "cpu",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    with LLM("tiny", max_model_len=64, **COMMON) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def _run(**kw) -> tuple[list[list[int]], LLM]:
    with LLM("tiny", max_model_len=64, **{**COMMON, **kw}) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, MultiprocExecutor)
        assert len(executor.pids) == llm.engine.layout.world_size
        assert len(_alive(executor.pids)) == len(executor.pids)
        outs = llm.generate(PROMPTS, PARAMS)
    assert not _alive(executor.pids), "workers outlived the with block"
    return [o.outputs[0].token_ids for o in outs], llm


def test_tp2_matches_one_process(single) -> None:
    got, _ = _run(tp=2)
    assert got == single


def test_spp2_matches_one_process_with_a_calibrated_cost_model(single) -> None:
    kw = {k: v for k, v in COMMON.items() if k != "cost_model"}
    with LLM("tiny", max_model_len=64, spp=2, cost_model=None, **kw) as llm:
        pids = llm.engine.executor.pids
        # the default: an online model seeded by the start-up calibration
        assert isinstance(llm.engine.cost_model, OnlineCostModel)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        # stream pipelining: a prompt's next chunk entered stage 0 while the
        # previous one ran on stage 1 (real chunk headers, order checks on)
        assert llm.engine.stats.max_in_flight == 2
        llm.shutdown()
        assert not _alive(pids)
        llm.shutdown()  # idempotent
    assert got == single


def test_kvp2_matches_one_process_and_reports_worker_exceptions(single) -> None:
    with LLM("tiny", max_model_len=64, kvp=2, kvp_group_tokens=32, **COMMON) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert got == single
        assert llm.engine.stats.sharded_chunks > 0  # prompts and decodes spanned both groups
        # a worker that raises sends its traceback, and the executor stops every worker
        executor = llm.engine.executor
        crossing = StepPlan(99, (PlannedChunk("x", 30, (1, 2, 3, 4), (0,), ()),))
        with pytest.raises(WorkerError, match="not inside shard"):
            executor.execute(crossing)
        assert not _alive(executor.pids)


def test_tp2_kvp2_four_ranks_match_one_process(single) -> None:
    got, llm = _run(tp=2, kvp=2, kvp_group_tokens=32)
    assert got == single
    assert llm.engine.stats.sharded_chunks > 0


def test_a_worker_killed_mid_step_is_a_clear_error() -> None:
    llm = LLM("tiny", spp=2, max_model_len=64, timeout_s=20, **COMMON)
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    pids = executor.pids
    executor.poll_s = 600.0  # no periodic check: the wait itself must see the death
    os.kill(pids[1], signal.SIGSTOP)  # stage 1 never answers the step
    executor.submit(StepPlan(7, (PlannedChunk("x", 0, (1, 2, 3, 4), (0,), ((0, (0,)),)),)))
    assert isinstance(executor.next_event(), StageCleared)  # stage 0 did its share
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match="rank 1 died during step 7"):
        executor.next_event()
    assert not _alive(pids)
    llm.shutdown()


def test_with_spp2_the_driver_waits_for_stage_0_before_the_oldest_batchs_end() -> None:
    """While stage 0 owes the newest batch, the oldest batch's end is read once the
    newest cleared stage 0 or ``stage0_first_s`` passed, whichever comes first, even
    when the last stage's reply is already in its pipe (read at once, it would put
    the driver beside stage 0's forward pass); 0 reads it at once."""
    llm = LLM("tiny", spp=2, max_model_len=64, timeout_s=20, **COMMON)
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    assert executor.stage0_first_s == 2e-3  # the default
    pids = executor.pids
    at = 0
    step = 0

    def stage0_stopped_for_0_3_s(first_s: float) -> list[tuple[type, int, float]]:
        """Run one batch through, then a second one while stage 0 is stopped for
        0.3 s: the next three events as (type, step id, seconds into the wait)."""
        nonlocal at, step
        executor.stage0_first_s = first_s
        blocks = ((0, (0,)),) if at == 0 else ()
        step += 1
        # stage 1 stopped until stage 0's reply is read: both replies ready at once would
        # be read together (a loaded machine delays the driver), the end already taken
        os.kill(pids[1], signal.SIGSTOP)
        try:
            executor.submit(StepPlan(step, (PlannedChunk("x", at, (1, 2), (0,), blocks),)))
            assert isinstance(executor.next_event(), StageCleared)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        assert executor.conns[1].poll(20.0)  # stage 1 replied: the batch's end waits
        os.kill(pids[0], signal.SIGSTOP)  # stage 0 cannot clear the next batch until resumed
        step += 1
        executor.submit(StepPlan(step, (PlannedChunk("x", at + 2, (3, 4), (0,), ()),)))
        at += 4
        timer = threading.Timer(0.3, os.kill, (pids[0], signal.SIGCONT))
        timer.start()
        try:
            t0 = time.monotonic()
            events = []
            for _ in range(3):
                event = executor.next_event()
                events.append((type(event), event.step_id - step, time.monotonic() - t0))
            return events
        finally:
            timer.cancel()
            os.kill(pids[0], signal.SIGCONT)

    try:
        # waiting long: stage 0's reply first, once resumed
        (a, b, c) = stage0_stopped_for_0_3_s(10.0)
        assert (a[:2], b[:2], c[:2]) == ((StageCleared, 0), (StepDone, -1), (StepDone, 0))
        assert a[2] > 0.2  # it waited for stage 0, not for the reply already there
        # waiting 50 ms: then the oldest batch's end, stage 0 still stopped
        (a, b, c) = stage0_stopped_for_0_3_s(0.05)
        assert (a[:2], b[:2], c[:2]) == ((StepDone, -1), (StageCleared, 0), (StepDone, 0))
        assert 0.04 < a[2] < 0.25 < b[2]
        # not waiting: the reply already there at once
        (a, b, c) = stage0_stopped_for_0_3_s(0.0)
        assert (a[:2], b[:2], c[:2]) == ((StepDone, -1), (StageCleared, 0), (StepDone, 0))
        assert a[2] < 0.2 < b[2]
    finally:
        llm.shutdown()


def test_a_killed_worker_is_a_clear_error() -> None:
    llm = LLM("tiny", tp=2, max_model_len=64, timeout_s=20, **COMMON)
    pids = llm.engine.executor.pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 died"):
        llm.generate(PROMPTS, PARAMS)
    assert time.monotonic() - t0 < 30
    assert not _alive(pids)  # the survivor was stopped too
    with pytest.raises(WorkerError, match="earlier failure"):
        llm.generate(PROMPTS, PARAMS)
    llm.shutdown()


# ------------------------------------------------------------------ pure parts
def test_stage_layers_split_evenly() -> None:
    assert [stage_layers(5, 2, s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [len(stage_layers(32, 3, s)) for s in range(3)] == [11, 11, 10]
    with pytest.raises(ValueError, match="spp=6"):
        stage_layers(5, 6, 0)


def test_group_batches_split_a_sequence_by_shard() -> None:
    tables = BlockTables()
    # request a: 40 tokens so far over groups (1, 0) with 32-token shards, block size 8;
    # its decode at position 40 lives on group 0 (the tail), shard 0 on group 1.
    a = PlannedChunk("a", 40, (7,), (1, 0), ((1, (4, 5, 6, 7)), (0, (9, 2))))
    b = PlannedChunk("b", 0, (1, 2, 3), (0,), ((0, (3,)),))
    tables.extend("a", a.new_blocks)
    tables.extend("b", b.new_blocks)
    plan = StepPlan(0, (a, b))
    kw = {"kvp": 2, "group_tokens": 32, "block_size": 8, "device": "cpu"}
    g0, shards0 = build_group_batch(plan, tables, group=0, **kw)
    assert g0.positions.tolist() == [40, 0, 1, 2]
    assert g0.kv_lens.tolist() == [9, 3]
    assert g0.slots.tolist() == [2 * 8 + 0, 24, 25, 26]  # local position 8 -> block 2
    assert shards0[:3] == ([1, 3], [9, 3], [True, True])
    assert [list(t) for t in shards0.block_tables] == [[9, 2], [3]]
    assert g0.block_table.tolist() == [[9, 2], [3, 0]]  # zero padding
    assert g0.host is not None and g0.host.max_block == 9
    assert g0.writes_kv
    g1, shards1 = build_group_batch(plan, tables, group=1, **kw)
    assert g1.slots.tolist() == [-1, -1, -1, -1]  # group 1 writes nothing
    assert not g1.writes_kv  # ... so its layers skip the KV write altogether
    assert g1.kv_lens.tolist() == [32, 0]
    assert shards1[:3] == ([1, 3], [32, 0], [False, False])
    assert [list(t) for t in shards1.block_tables] == [[4, 5, 6, 7], []]
    assert g1.block_table.tolist() == [[4, 5, 6, 7], [0, 0, 0, 0]]
    assert g1.host is not None and g1.host.max_block == 7
    crossing = StepPlan(1, (PlannedChunk("a", 30, (1, 2, 3, 4), (1,), ()),))
    with pytest.raises(ValueError, match="not inside shard"):
        build_group_batch(crossing, tables, group=0, **kw)


def test_distributed_executor_pipelines_spp2_across_its_ranks(single, monkeypatch) -> None:
    """The torch.distributed executor (this process is rank 0, one local worker):
    a prompt's second chunk enters stage 0 while stage 1 (SIGSTOPped) has not
    taken the first; then one process's tokens, and keepalives while idle."""
    import threading

    from medha_runtime.dist_config import RENDEZVOUS_ENV, DistConfig
    from medha_runtime.dist_executor import DistributedExecutor
    from tests.server.conftest import free_port

    for name in RENDEZVOUS_ENV:
        monkeypatch.delenv(name, raising=False)
    dist = DistConfig(
        world_size=2, local_ranks=2, master_port=free_port(), control_timeout_s=60, keepalive_s=2
    )
    with LLM("tiny", max_model_len=64, spp=2, distributed=dist, **COMMON) as llm:
        engine, executor = llm.engine, llm.engine.executor
        assert isinstance(executor, DistributedExecutor) and executor.sampler_rank == 1
        (worker,) = executor.processes
        engine.add_request(engine.encode(PROMPTS[0]), PARAMS, request_id="long")
        outs: list = []
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            runner = threading.Thread(target=lambda: outs.extend(engine.step()), daemon=True)
            runner.start()
            deadline = time.monotonic() + 30
            while engine.stats.max_in_flight < 2:  # 16-token chunks: the prompt has two
                assert time.monotonic() < deadline, "the second chunk never entered stage 0"
                time.sleep(0.01)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        runner.join(timeout=60)
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        assert [o.outputs[0].token_ids for o in outs if o.finished] == single[:1]
        time.sleep(2.5)  # idle past a keepalive period: the pings reach the worker
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == single
    assert worker.exitcode == 0
    # join_world's variables are gone again: a server started from this process
    # later must not believe it runs under torchrun
    assert not [name for name in RENDEZVOUS_ENV if name in os.environ]
