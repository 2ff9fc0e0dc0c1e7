"""Async scheduling with stream pipelining (spp = 2, 3): a decode is issued once the
batch before it cleared stage 0, the last stage sends its sampled tokens straight to
stage 0 (``medha_parallel.TokenReturn``), and the outputs are one process's
synchronous outputs, whatever stops, aborts, chunks or finishes the requests."""

from __future__ import annotations

import pytest

from medha_runtime import SamplingParams
from medha_runtime.config import EngineConfig
from medha_runtime.dist_config import DistConfig
from medha_runtime.executor import MultiprocExecutor, StageCleared
from medha_runtime.model.tiny import tiny_config
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.runner import ReturnedTokens, RunnerSpec, _pending_rows
from medha_runtime.sampling import SampleSpec
from medha_sched import PENDING_TOKEN
from tests.runtime.test_async_scheduling import assert_same, make_engine, prompts, summary

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the long prompt (q6) goes in chunks of at most 32 tokens while the others decode
CHUNKED = {"chunk_size": 32, "max_model_len": 256, "kv_cache_tokens": 4096}


@pytest.fixture(scope="module")
def workload() -> tuple[list, str]:
    """The requests (q0's greedy text gives q3 its stop string)."""
    ps = prompts(6, seed=9)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(False, **CHUNKED)
    try:
        engine.add_request(ps[0], greedy, request_id="ref")
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = o
        assert out is not None
        text = out.outputs[0].text
    finally:
        engine.shutdown()
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    long_prompt = [(11 * i) % 240 + 5 for i in range(150)]
    requests = [
        (ps[0], greedy),  # q0
        (ps[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)),
        (ps[2], SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=18)),
        (ps[0], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True)),
        (ps[3], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
        (ps[4], SamplingParams(temperature=0.8, seed=2, max_tokens=9, frequency_penalty=0.3)),
        (long_prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)),  # q6
        (ps[5], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),  # q7: aborted
    ]
    return requests, stop


def _generate(async_: bool, requests: list, **layout) -> tuple[dict, dict]:
    """Every request's summary (q7 aborted after 8 steps; q5 and q6 arrive at step 3,
    while the others decode) and what the engine did."""
    engine = make_engine(async_, **CHUNKED, **layout)
    seen = {"pending": 0, "pending_batches": [], "cleared_before_issue": True}
    submit, next_event = engine.executor.submit, engine.executor.next_event
    cleared: set[int] = set()
    shipped: list[int] = []

    def counting(plan):  # type: ignore[no-untyped-def]
        n = sum(1 for c in plan.chunks if c.token_ids == (PENDING_TOKEN,))
        if n:
            seen["pending"] += n
            seen["pending_batches"].append(plan.step_id)
            # a decode goes ahead only once the batch before it really cleared stage 0
            seen["cleared_before_issue"] &= bool(shipped) and shipped[-1] in cleared
        shipped.append(plan.step_id)
        return submit(plan)

    def watched():  # type: ignore[no-untyped-def]
        event = next_event()
        if isinstance(event, StageCleared):
            cleared.add(event.step_id)
        return event

    engine.executor.submit = counting  # type: ignore[method-assign]
    engine.executor.next_event = watched  # type: ignore[method-assign]
    done: dict = {}
    try:
        first = [0, 1, 2, 3, 4, 7]
        for i in first:
            engine.add_request(*requests[i], request_id=f"q{i}")
        steps = 0
        while engine.has_unfinished_requests():
            outs = list(engine.step())
            steps += 1
            if steps == 3:
                for i in (5, 6):
                    engine.add_request(*requests[i], request_id=f"q{i}")
            if steps == 8:
                now = engine.abort_request("q7")
                if now is not None:
                    outs.append(now)
            for out in outs:
                done[out.request_id] = summary(out)
        seen["max_in_flight"] = engine.stats.max_in_flight
        seen["executor"] = type(engine.executor)
    finally:
        engine.shutdown()
    return done, seen


@pytest.fixture(scope="module")
def reference(workload) -> dict:
    """One process, synchronous."""
    requests, _ = workload
    return _generate(False, requests)[0]


@pytest.mark.parametrize("spp", [2, 3])
def test_async_spp_gives_the_one_process_sync_outputs(spp: int, workload, reference) -> None:
    requests, stop = workload
    got, seen = _generate(True, requests, spp=spp)
    assert seen["executor"] is MultiprocExecutor
    assert seen["pending"] > 0 and seen["cleared_before_issue"]
    assert seen["max_in_flight"] == spp
    # q7 was aborted: its tokens so far are a prefix of what it gives unaborted
    aborted, ref_aborted = got.pop("q7"), reference["q7"]
    assert_same({r: o for r, o in reference.items() if r != "q7"}, got)
    assert reference["q3"][2:4] == ("stop", stop) and stop not in reference["q3"][1]
    assert [len(reference[f"q{i}"][0]) for i in (1, 4, 6)] == [24, 1, 7]
    for out in (aborted, ref_aborted):
        assert out[2] == "abort" and 0 < len(out[0]) < 30
    short = min(len(aborted[0]), len(ref_aborted[0]))
    assert aborted[0][:short] == ref_aborted[0][:short]


def test_async_spp2_with_tp2_and_kvp2(workload, reference) -> None:
    """Two stage-0 ranks (TP, then KVP) each take the last stage's tokens."""
    requests, _ = workload
    for layout in ({"tp": 2}, {"kvp": 2, "kvp_group_tokens": 128}):
        got, seen = _generate(True, requests, spp=2, **layout)
        assert seen["pending"] > 0 and seen["max_in_flight"] == 2
        got.pop("q7")
        assert_same({r: o for r, o in reference.items() if r != "q7"}, got)


def test_async_spp_is_allowed_on_workers_and_refused_distributed() -> None:
    config = EngineConfig(async_scheduling=True, spp=2, max_model_len=256)
    assert config.resolve(tiny_config()).spec.pending_tokens is True
    assert RunnerSpec(model="tiny", spp=3, pending_tokens=True).pending_tokens is True
    dist = DistConfig(world_size=4, local_ranks=4)
    with pytest.raises(ValueError) as info:
        EngineConfig(async_scheduling=True, tp=2, spp=2, distributed=dist)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("async_scheduling=True with spp=2 (tp=2, spp=2, kvp=1) needs")
    assert "torch.distributed executor" in message and "spp = 1 only" in message
    with pytest.raises(
        ValueError,
        match="spp=2 takes at most 4096 requests per batch, got max_batch_requests=4097",
    ):
        EngineConfig(async_scheduling=True, spp=2, max_batch_requests=4097)
    assert EngineConfig(async_scheduling=True, spp=2, max_batch_requests=4096)
    # spp = 1 stays allowed there
    assert EngineConfig(async_scheduling=True, tp=2, distributed=DistConfig(world_size=2))
    # the executor itself refuses it too, before starting anything
    from medha_runtime.dist_executor import DistributedExecutor

    spec = RunnerSpec(model="tiny", spp=2, pending_tokens=True)
    refused = r"\(pending_tokens\) with spp=2 \(tp=1, kvp=1\) needs worker"
    with pytest.raises(ValueError, match=refused):
        DistributedExecutor(spec, DistConfig(world_size=2, local_ranks=2))


class _Channel:
    """A stand-in for TokenReturn's receiving end: messages queued by the test."""

    def __init__(self) -> None:
        self.messages: list[list[int]] = []

    def arrived(self) -> bool:
        return bool(self.messages)

    def recv(self, count: int) -> list[int]:
        ids = self.messages.pop(0)
        assert len(ids) == count
        return ids


def _plan(step: int, *rids: str) -> StepPlan:
    chunks = tuple(
        PlannedChunk(r, 5, (PENDING_TOKEN,), (0,), (), SampleSpec(r, 0.0, 0, 1.0, 0, None))
        for r in rids
    )
    return StepPlan(step, chunks)


def test_returned_tokens_keep_order_and_skip_requests_dropped_after_their_batch() -> None:
    channel, last = _Channel(), {}
    back = ReturnedTokens(channel, last)  # type: ignore[arg-type]
    back.take(block=False)
    back.ran(_plan(0, "a", "b"))  # batch 0 samples a and b
    back.ran(_plan(1, "a"))  # batch 1 samples a
    back.drop(["b"])  # b finished before batch 2: batch 0's id for it is stale
    channel.messages.append([10, 20])
    back.take(block=False)  # batch 0's ids arrived, batch 1's not yet: no wait
    assert last == {"a": 10} and back.gone == {"b": 2}
    channel.messages.append([11])
    back.take(block=True)
    assert last == {"a": 11} and not back.waiting and back.gone == {}
    back.ran(_plan(2, "b"))  # b again (a new request with that id): its ids count
    channel.messages.append([30])
    back.take(block=True)
    assert last == {"a": 11, "b": 30}
    assert _pending_rows(_plan(3, "a", "b")) == [(0, "a"), (1, "b")]


def test_llm_spp2_async_greedy_tokens_are_one_process_sync() -> None:
    """The offline API: ``LLM(spp=2, async_scheduling=True)`` against ``LLM()``, greedy,
    prompts of different lengths reaching max_tokens at different steps."""
    from medha_runtime import LLM
    from tests.runtime.test_async_scheduling import COST

    ps = prompts(5, seed=21)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 17, 9, 25, 1)
    ]
    outs = {}
    for async_, spp in ((False, 1), (True, 2)):
        with LLM(
            "tiny", spp=spp, async_scheduling=async_, max_model_len=256, cost_model=COST, seed=3
        ) as llm:
            assert llm.engine.resolved.spec.pending_tokens is async_
            outs[spp] = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
            in_flight = llm.engine.stats.max_in_flight
            if async_:  # deeper than the token ring: the last stage would block on it
                with pytest.raises(
                    ValueError,
                    match="pipeline_depth=9 with async scheduling "
                    "and spp=2 exceeds the 8 batches the token return ring",
                ):
                    llm.engine.pipeline_depth = 9
                llm.engine.pipeline_depth = 8
    assert [len(t) for t in outs[1]] == [3, 17, 9, 25, 1]
    assert outs[2] == outs[1] and in_flight == 2


def test_a_small_kv_pool_preempts_with_spp2_async() -> None:
    """Preempted requests (their last tokens dropped on stage 0, then recomputed)
    give one process's synchronous outputs."""
    from tests.runtime.test_async_scheduling import run

    ps = prompts(6, seed=3)
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)) for p in ps]
    requests += [(ps[0], SamplingParams(temperature=0.8, seed=4, max_tokens=40))]
    got = {}
    for async_, spp in ((False, 1), (True, 2)):
        engine = make_engine(async_, spp=spp, kv_cache_tokens=224, max_model_len=128)
        pending = []
        submit = engine.executor.submit

        def counting(plan, submit=submit, pending=pending):  # type: ignore[no-untyped-def]
            pending.extend(c for c in plan.chunks if c.token_ids == (PENDING_TOKEN,))
            return submit(plan)

        engine.executor.submit = counting  # type: ignore[method-assign]
        try:
            got[spp] = run(engine, requests)
            stats = engine.stats
        finally:
            engine.shutdown()
        assert stats.preemptions > 0
        assert bool(pending) is async_
    assert_same(got[1], got[2])
