"""Async scheduling on worker processes (tp = 2, kvp = 2, both; spp = 1, and
test_async_spp.py for spp > 1): the sampling rank broadcasts each step's tokens,
every rank fills the next batch's decodes issued ahead, and the outputs are the
synchronous engine's."""

from __future__ import annotations

import pytest

from medha_runtime import SamplingParams
from medha_runtime.config import EngineConfig
from medha_runtime.executor import StepDone
from medha_runtime.model.tiny import tiny_config
from medha_runtime.runner import RunnerSpec
from medha_sched import PENDING_TOKEN
from tests.runtime.test_async_scheduling import assert_same, make_engine, prompts, run, summary

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYOUTS = [
    pytest.param({"tp": 2}, id="tp2"),
    # 32-token shards: the 36-token prompt's decodes span both KVP groups
    pytest.param({"kvp": 2, "kvp_group_tokens": 32, "max_model_len": 64}, id="kvp2"),
    # 4 ranks: the sampling rank's tokens reach the other TP rank of its KVP
    # group and both ranks of the other group
    pytest.param({"tp": 2, "kvp": 2, "kvp_group_tokens": 32, "max_model_len": 64}, id="tp2kvp2"),
]


@pytest.fixture(scope="module")
def workload() -> tuple[list, str, list[int]]:
    """The requests (a stop string among them) and the greedy tokens of the
    first prompt from one process (the stop string is cut from their text)."""
    ps = prompts(4, seed=5)
    ps[1] = [(7 * i) % 240 + 3 for i in range(36)]
    engine = make_engine(False, kv_cache_tokens=4096)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        ref = run(engine, [(ps[0], greedy)])["q0"]
        text = engine.tokenizer.decode(ref[0])  # type: ignore[union-attr]
    finally:
        engine.shutdown()
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    requests = [
        (ps[0], greedy),  # q0: the reference of q4 (aborted)
        (ps[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)),
        (ps[2], SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=18)),
        (ps[0], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop], ignore_eos=True)),
        (ps[0], greedy),  # q4: aborted after a few steps
        (ps[3], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
        (ps[3], SamplingParams(temperature=0.8, seed=2, max_tokens=9, frequency_penalty=0.3)),
    ]
    return requests, stop, ref[0]


def _generate(async_: bool, layout: dict, requests: list) -> tuple[dict, dict]:
    """Every request's output (q4 aborted after 5 steps) and what was submitted."""
    engine = make_engine(async_, kv_cache_tokens=4096, **layout)
    seen = {"pending": 0, "pending_sharded": 0}
    submit = engine.executor.submit

    def counting(plan):  # type: ignore[no-untyped-def]
        for c in plan.chunks:
            if c.token_ids == (PENDING_TOKEN,):
                seen["pending"] += 1
                seen["pending_sharded"] += len(c.kvp_groups) > 1
        return submit(plan)

    engine.executor.submit = counting  # type: ignore[method-assign]
    done: dict = {}
    try:
        for i, (ids, params) in enumerate(requests):
            engine.add_request(ids, params, request_id=f"q{i}")
        steps = 0
        while engine.has_unfinished_requests():
            outs = list(engine.step())
            steps += 1
            if steps == 5:
                now = engine.abort_request("q4")
                if now is not None:
                    outs.append(now)
            for out in outs:
                done[out.request_id] = summary(out)
        seen["max_in_flight"] = engine.stats.max_in_flight
    finally:
        engine.shutdown()
    return done, seen


@pytest.mark.parametrize("layout", LAYOUTS)
def test_async_on_workers_gives_the_sync_outputs(layout: dict, workload) -> None:
    requests, stop, ref = workload
    sync, seen_sync = _generate(False, layout, requests)
    async_, seen = _generate(True, layout, requests)
    assert seen_sync["pending"] == 0 and seen_sync["max_in_flight"] == 1
    assert seen["pending"] > 0 and seen["max_in_flight"] == 2
    if "kvp" in layout:
        assert seen["pending_sharded"] > 0  # decodes issued ahead over both KVP groups
    aborted = {r: o for r, o in async_.items() if r == "q4"}
    assert_same(
        {r: o for r, o in sync.items() if r != "q4"}, {r: o for r, o in async_.items() if r != "q4"}
    )
    for out in (sync["q0"], async_["q0"]):
        assert out[0] == ref and out[2] == "length"
    assert sync["q3"][2:4] == ("stop", stop) and stop not in sync["q3"][1]
    assert [len(sync[f"q{i}"][0]) for i in (1, 5)] == [24, 1]
    for out in (sync["q4"], aborted["q4"]):
        assert out[2] == "abort" and 0 < len(out[0]) < 20
        assert out[0] == ref[: len(out[0])]


def test_async_with_any_layout_is_accepted_by_the_config_and_the_runner_spec() -> None:
    # spp > 1 too (tests/runtime/test_async_spp.py runs it; only the torch.distributed
    # executor refuses it)
    config = EngineConfig(async_scheduling=True, tp=2, kvp=2, max_model_len=256)  # any tp, kvp
    assert config.resolve(tiny_config()).spec.pending_tokens is True
    config = EngineConfig(async_scheduling=True, spp=2, max_model_len=256)
    assert config.resolve(tiny_config()).spec.pending_tokens is True
    assert RunnerSpec(model="tiny", spp=3, pending_tokens=True).world_size == 3


def test_distributed_executor_runs_async_tp2(workload, monkeypatch) -> None:
    """The torch.distributed executor (this process is rank 0 and the sampling
    rank, one local worker) runs the same worker loop: rank 1 takes rank 0's
    tokens and the outputs are one process's."""
    from medha_runtime.dist_config import RENDEZVOUS_ENV, DistConfig
    from medha_runtime.dist_executor import DistributedExecutor
    from tests.server.conftest import free_port

    requests, stop, ref = workload
    for name in RENDEZVOUS_ENV:
        monkeypatch.delenv(name, raising=False)
    dist = DistConfig(world_size=2, local_ranks=2, master_port=free_port(), control_timeout_s=60)
    engine = make_engine(True, kv_cache_tokens=4096, tp=2, device="cpu", distributed=dist)
    recorded, own = [], []
    record, next_event = engine.cost_feedback.record, engine.executor.next_event

    def recording(out, seconds, stage_s=()):  # type: ignore[no-untyped-def]
        recorded.append(seconds)
        return record(out, seconds, stage_s)

    def watched():  # type: ignore[no-untyped-def]
        event = next_event()
        if isinstance(event, StepDone):
            own.append(event.stage_s)
        return event

    engine.cost_feedback.record = recording  # type: ignore[method-assign]
    engine.executor.next_event = watched  # type: ignore[method-assign]
    try:
        assert isinstance(engine.executor, DistributedExecutor)
        assert engine.executor.sampler_rank == 0
        got = run(engine, [requests[0], requests[3]])
        assert engine.stats.max_in_flight == 2
    finally:
        engine.shutdown()
    assert got["q0"][0] == ref and got["q0"][2] == "length"
    assert got["q1"][2:4] == ("stop", stop)
    assert got["q1"][0] == ref[: len(got["q1"][0])]
    # the cost model learns each batch's own seconds, not the wait behind the previous one
    assert [s[0] for s in own] == recorded and all(s > 0 for s in recorded)
