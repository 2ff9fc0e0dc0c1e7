"""Async scheduling (``EngineConfig.async_scheduling``): batch N+1 is formed and
shipped while the model runs batch N; outputs must be those of the synchronous
engine, whatever stops, aborts or preempts the requests."""

from __future__ import annotations

import random

import pytest

from medha_runtime import SamplingParams
from medha_runtime.cli import build_parser, engine_config
from medha_runtime.config import EngineConfig
from medha_runtime.dist_config import DistConfig
from medha_runtime.engine import LLMEngine
from medha_runtime.executor import StepDone
from medha_runtime.step_log import read_step_log
from medha_sched import PENDING_TOKEN, AffineCostModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)


def make_engine(async_: bool, **kwargs) -> LLMEngine:
    base = {"max_model_len": 256, "cost_model": COST, "policy": "fcfs", "seed": 3}
    return LLMEngine("tiny", async_scheduling=async_, **(base | kwargs))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def summary(out) -> tuple:  # type: ignore[no-untyped-def]
    """A finished request's ``(token ids, text, finish, stop, logprobs)``."""
    c = out.outputs[0]
    return (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], *, eos=None):
    """Every request to completion: ``{request id: (token ids, text, finish, stop, logprobs)}``."""
    if eos is not None:
        engine.eos_token_ids = frozenset(eos)
    for i, (ids, params) in enumerate(requests):
        engine.add_request(ids, params, request_id=f"q{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = summary(out)
    return done


def both(requests, *, eos=None, **kwargs):
    """The sync and the async engine's outputs, and the async engine's counters."""
    results = []
    pending = 0
    for async_ in (False, True):
        engine = make_engine(async_, **kwargs)
        submit = engine.executor.submit

        def counting(plan, submit=submit):  # type: ignore[no-untyped-def]
            nonlocal pending
            pending += sum(1 for c in plan.chunks if c.token_ids == (PENDING_TOKEN,))
            return submit(plan)

        engine.executor.submit = counting  # type: ignore[method-assign]
        try:
            results.append(run(engine, requests, eos=eos))
            stats = engine.stats
        finally:
            engine.shutdown()
        if not async_:
            assert stats.max_in_flight == 1 and pending == 0
    return results[0], results[1], stats, pending


def assert_same(sync: dict, async_: dict) -> None:
    assert sync.keys() == async_.keys()
    for rid in sync:
        s, a = sync[rid], async_[rid]
        assert s[:4] == a[:4], f"{rid}: sync {s[:4]} async {a[:4]}"
        if s[4] is not None:
            assert len(s[4]) == len(a[4])
            for x, y in zip(s[4], a[4], strict=True):
                assert x.keys() == y.keys()
                for t in x:
                    assert x[t] == pytest.approx(y[t], abs=1e-4)


def greedy_reference(ids: list[int], n: int) -> list[int]:
    engine = make_engine(False)
    try:
        got = run(engine, [(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))])
    finally:
        engine.shutdown()
    return got["q0"][0]


def test_sampling_options_give_the_sync_outputs() -> None:
    ps = prompts(8)
    requests = [
        (ps[0], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)),
        (ps[1], SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11, max_tokens=23)),
        (ps[2], SamplingParams(temperature=0.7, max_tokens=19)),  # the engine's derived seed
        (
            ps[3],
            SamplingParams(
                temperature=0.8,
                seed=5,
                max_tokens=21,
                presence_penalty=0.5,
                frequency_penalty=0.3,
                repetition_penalty=1.2,
            ),
        ),
        (ps[4], SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)),
        (ps[5], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
        (ps[6], SamplingParams(temperature=1.0, seed=2, max_tokens=30, min_p=0.05)),
        (ps[7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)),
    ]
    sync, async_, stats, pending = both(requests, kv_cache_tokens=4096)
    assert_same(sync, async_)
    assert stats.max_in_flight == 2
    assert pending > 0  # decodes were issued ahead
    assert [len(sync[f"q{i}"][0]) for i in (0, 5, 7)] == [17, 1, 2]
    assert sync["q4"][4] is not None and len(sync["q4"][4]) == 12


def test_bad_words_give_the_sync_outputs() -> None:
    """A longer bad word's ban needs the output's last tokens, one of which may still be
    in flight when a decode is issued ahead: the sampler keeps them itself."""
    ids = [ord(c) for c in "The quick brown fox"]
    ref = greedy_reference(ids, 12)
    i = next(i for i in range(1, 11) if ref[i] < 128 and ref[i + 1] < 128)
    word = chr(ref[i]) + chr(ref[i + 1])  # tiny's byte tokens: two tokens
    banned = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[word])
    sampled = banned.replace(temperature=0.9, seed=4, bad_words=[word, chr(ref[0])])
    sync, async_, _, pending = both([(ids, banned), (ids, sampled)], kv_cache_tokens=4096)
    assert_same(sync, async_)
    assert pending > 0
    got = sync["q0"][0]
    assert got[: i + 1] == ref[: i + 1] and got[i + 1] != ref[i + 1]
    assert ref[0] not in sync["q1"][0]


def test_prompt_logprobs_of_a_chunked_prompt_match() -> None:
    """With async scheduling a prompt's next chunk is planned before the
    previous chunk's prompt logprobs are back: every position is still asked
    for exactly once."""
    ids = prompts(1, seed=4)[0] * 4  # 16-160 tokens, prefilled in chunks of 16
    got = []
    for async_ in (False, True):
        engine = make_engine(async_, kv_cache_tokens=4096, token_grid=8, target_batch_time=0.0012)
        chunks = []
        submit = engine.executor.submit

        def recording(plan, submit=submit, chunks=chunks):  # type: ignore[no-untyped-def]
            chunks.extend(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
            return submit(plan)

        engine.executor.submit = recording  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1, ignore_eos=True)
        try:
            engine.add_request(ids, params, request_id="p")
            outs = []
            while engine.has_unfinished_requests():
                outs += engine.step()
            in_flight = engine.stats.max_in_flight
        finally:
            engine.shutdown()
        assert len(chunks) > 1  # the prompt was prefilled in several chunks
        assert in_flight == (2 if async_ else 1)
        (out,) = outs
        got.append((out.outputs[0].token_ids, out.prompt_logprobs))
    (sync_ids, sync_lp), (async_ids, async_lp) = got
    assert sync_ids == async_ids
    assert len(sync_lp) == len(async_lp) == len(ids)
    assert sync_lp[0] is None and all(e is not None for e in sync_lp[1:])
    for x, y in zip(sync_lp[1:], async_lp[1:], strict=True):
        assert x.keys() == y.keys()
        for t in x:
            assert x[t] == pytest.approx(y[t], abs=1e-4)


def test_stop_tokens_stop_strings_eos_and_min_tokens_match() -> None:
    ps = prompts(6, seed=1)
    ref = greedy_reference(ps[0], 24)
    # a token first seen at output index k: a stop there, unless min_tokens suppresses it
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    stop_tok = ref[k]
    engine = make_engine(False)
    text = engine.tokenizer.decode(ref)  # type: ignore[union-attr]
    engine.shutdown()
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    g = {"temperature": 0.0, "max_tokens": 24}
    requests = [
        (ps[0], SamplingParams(**g, stop_token_ids=[stop_tok], ignore_eos=True)),
        (ps[0], SamplingParams(**g, stop_token_ids=[stop_tok], min_tokens=k, ignore_eos=True)),
        (ps[0], SamplingParams(**g, stop_token_ids=[stop_tok], min_tokens=k + 1)),
        (ps[0], SamplingParams(**g, stop=[stop_str], ignore_eos=True)),
        (
            ps[0],
            SamplingParams(**g, stop=[stop_str], include_stop_str_in_output=True, ignore_eos=True),
        ),
        (ps[0], SamplingParams(**g)),  # EOS (set below to stop_tok)
        (ps[0], SamplingParams(**g, min_tokens=k)),  # EOS suppressed until index k
        (ps[0], SamplingParams(**g, ignore_eos=True)),
        (ps[1], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
    ]
    sync, async_, _, _ = both(requests, eos=[stop_tok], kv_cache_tokens=4096)
    assert_same(sync, async_)
    assert sync["q0"][0] == ref[: k + 1] and sync["q0"][2:4] == ("stop", stop_tok)
    assert sync["q1"][0] == ref[: k + 1]  # min_tokens=k lets index k stop
    assert len(sync["q2"][0]) > k + 1 or sync["q2"][2] == "length"
    assert sync["q3"][2:4] == ("stop", stop_str) and stop_str not in sync["q3"][1]
    assert sync["q4"][1].endswith(stop_str)
    assert sync["q5"][0] == ref[: k + 1] and sync["q5"][2:4] == ("stop", None)
    assert sync["q6"][0] == ref[: k + 1]
    assert sync["q7"][0] == ref and sync["q7"][2] == "length"


def test_abort_mid_flight_keeps_a_prefix_and_the_others_unchanged() -> None:
    ps = prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = {}
    for async_ in (False, True):
        engine = make_engine(async_, kv_cache_tokens=4096)
        try:
            for i, ids in enumerate(ps):
                engine.add_request(ids, params, request_id=f"q{i}")
            outs = {}
            for _ in range(8):
                for out in engine.step():
                    outs[out.request_id] = out
            now = engine.abort_request("q1")
            if async_:
                assert now is None  # its next decode is in flight: it ends with that batch
            else:
                assert now is not None and now.outputs[0].finish_reason == "abort"
                outs["q1"] = now
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outs[out.request_id] = out
            full[async_] = {rid: out.outputs[0] for rid, out in outs.items()}
        finally:
            engine.shutdown()
    ref = greedy_reference(ps[1], 40)
    for async_ in (False, True):
        aborted = full[async_]["q1"]
        assert aborted.finish_reason == "abort"
        assert 0 < len(aborted.token_ids) < 40
        assert aborted.token_ids == ref[: len(aborted.token_ids)]
    for rid in ("q0", "q2", "q3"):
        assert full[True][rid].token_ids == full[False][rid].token_ids
        assert len(full[True][rid].token_ids) == 40


def test_a_small_kv_pool_preempts_and_gives_the_sync_outputs() -> None:
    ps = prompts(6, seed=3)
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)) for p in ps]
    requests += [(ps[0], SamplingParams(temperature=0.8, seed=4, max_tokens=40))]
    sync, async_, stats, pending = both(requests, kv_cache_tokens=224, max_model_len=128)
    assert_same(sync, async_)
    assert stats.preemptions > 0
    assert pending > 0


def test_execution_time_is_the_batch_own_in_the_cost_feedback_and_step_log(tmp_path) -> None:
    log = tmp_path / "steps.jsonl"
    engine = make_engine(True, kv_cache_tokens=4096, step_log=str(log))
    own: dict[int, float] = {}
    recorded: dict[int, float] = {}
    next_event, record = engine.executor.next_event, engine.cost_feedback.record

    def watched():  # type: ignore[no-untyped-def]
        event = next_event()
        if isinstance(event, StepDone):
            own[event.step_id] = event.stage_s[0]
        return event

    def recording(out, seconds, stage_s=()):  # type: ignore[no-untyped-def]
        recorded[out.batch_id] = seconds
        return record(out, seconds, stage_s)

    engine.executor.next_event = watched  # type: ignore[method-assign]
    engine.cost_feedback.record = recording  # type: ignore[method-assign]
    try:
        run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in prompts(4)])
        assert engine.stats.max_in_flight == 2
    finally:
        engine.shutdown()
    assert recorded == own and len(own) == engine.stats.steps
    steps = read_step_log(log)
    assert [r.step for r in steps] == list(own)
    for r in steps:
        assert r.execute_s == pytest.approx(own[r.step], abs=1e-6)
        assert r.schedule_s >= 0 and r.finish_s >= 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"async_scheduling": "yes"},
            "async_scheduling must be True, False or None (auto), got 'yes'",
        ),
        (
            {"async_scheduling": True, "spp": 2, "distributed": DistConfig(world_size=2)},
            "async_scheduling=True with spp=2 (tp=1, spp=2, kvp=1) needs worker processes "
            "on one host",
        ),
        (
            {"async_scheduling": True, "tp": 2, "spp": 4, "distributed": DistConfig(world_size=8)},
            "executor (distributed=...) runs it with spp = 1 only",
        ),
    ],
)
def test_bad_async_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**kwargs)


def test_serve_flag_and_scheduler_config() -> None:
    args = build_parser().parse_args(["serve", "tiny", "--async-scheduling"])
    config = engine_config(args, distributed=None)
    assert config.async_scheduling is True
    default = engine_config(build_parser().parse_args(["serve"]), distributed=None)
    assert default.async_scheduling is None  # auto
    off = build_parser().parse_args(["serve", "--spp", "2", "--no-async-scheduling"])
    assert engine_config(off, distributed=None).async_scheduling is False
    from medha_runtime.config import async_on, scheduler_config

    assert scheduler_config(config).async_decodes is True
    # auto: off with one stage, on with spp > 1 on one host; explicit False wins
    assert scheduler_config(EngineConfig()).async_decodes is False
    from medha_parallel import shm

    assert async_on(EngineConfig(spp=2)) is shm.supported()  # Linux on x86-64
    assert scheduler_config(EngineConfig(spp=2)).async_decodes is shm.supported()
    assert async_on(EngineConfig(spp=2, async_scheduling=False)) is False
    assert async_on(EngineConfig(spp=2, max_batch_requests=5000)) is False  # ids: one message
    dist = DistConfig(world_size=2, local_ranks=2)
    assert async_on(EngineConfig(spp=2, distributed=dist)) is False  # no shared-memory path


def test_only_the_async_runner_keeps_last_tokens() -> None:
    for async_ in (False, True):
        engine = make_engine(async_, kv_cache_tokens=4096)
        try:
            assert engine.resolved.spec.pending_tokens is async_
            run(engine, [(prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=4))])
            kept = engine.executor.runner._last_token  # type: ignore[attr-defined]
            assert (kept is not None) is async_
        finally:
            engine.shutdown()


def test_staggered_arrivals_give_the_sync_outputs() -> None:
    """Requests arrive while others decode: prefills end with the decodes' batch in
    flight (they join the running lane at once) and requests reach max_tokens at
    different steps (they leave it before the others go ahead)."""
    rng = random.Random(7)
    specs = []
    for i, ids in enumerate(prompts(14, seed=4)):
        n = rng.randrange(3, 30)
        if i % 3 == 0:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=n, frequency_penalty=0.2)
        elif i % 3 == 1:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=2)
        specs.append((ids, params))
    results = {}
    for async_ in (False, True):
        engine = make_engine(async_, kv_cache_tokens=4096)
        submit, overlapped = engine.executor.submit, []

        def counting(plan, submit=submit, engine=engine, overlapped=overlapped):  # type: ignore[no-untyped-def]
            overlapped.append(engine.executor.in_flight > 0)
            return submit(plan)

        engine.executor.submit = counting  # type: ignore[method-assign]
        done = {}
        try:
            pending = list(enumerate(specs))
            while pending or engine.has_unfinished_requests():
                for _ in range(2):
                    if pending:
                        i, (ids, params) = pending.pop(0)
                        engine.add_request(ids, params, request_id=f"q{i}")
                for out in engine.step():
                    done[out.request_id] = summary(out)
        finally:
            engine.shutdown()
        results[async_] = done
        assert any(overlapped) is async_
        if async_:
            assert sum(overlapped) > len(overlapped) // 2
    assert_same(results[False], results[True])
    assert len(results[True]) == len(specs)
