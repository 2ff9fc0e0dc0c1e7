"""The server's log lines, as pure functions of plain data (no server started)."""

from __future__ import annotations

import dataclasses

from medha_runtime.server.logs import StatsLogger, access_line, startup_summary
from medha_runtime.server.messages import EngineReady, Heartbeat, ModelInfo


def beat(running: int, waiting: int, prefill: int, decode: int) -> Heartbeat:
    return Heartbeat(
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=0.25,
        num_preemptions=0,
        steps=1,
        median_prediction_error=0.125,
        prefill_tokens=prefill,
        decode_tokens=decode,
    )


def test_stats_line_while_busy_and_none_when_idle() -> None:
    s = StatsLogger(10.0)
    s.on_heartbeat(beat(1, 0, 100, 0))
    t0 = s._last[0]  # type: ignore[index]
    s.on_heartbeat(beat(2, 3, 600, 40))
    line = s.line(t0 + 10.0)
    assert line == (
        "running: 2 reqs, waiting: 3 reqs, prompt throughput: 50.0 tokens/s, generation "
        "throughput: 4.0 tokens/s, KV cache usage: 25.0%, median step-time prediction "
        "error: 12.5%"
    )
    s.on_heartbeat(beat(0, 0, 600, 40))
    assert s.line(t0 + 20.0) is None  # nothing ran: no line


def _info() -> ModelInfo:
    return ModelInfo(
        device="cpu",
        policy="lars-mp",
        cost_model="OnlineCostModel",
        target_batch_time=0.05,
        kv_pool_tokens=2048,
        kvp_group_tokens=256,
        block_size=16,
        vocab_size=259,
    )


def test_summary_and_access_line() -> None:
    info = _info()
    ready = EngineReady("tiny", 256, 123, "float32", "ParallelDegrees(tp=1, spp=2, kvp=1)", info)
    text = "\n".join(startup_summary(ready, served_name="t", address="http://127.0.0.1:8000"))
    parts = ["model tiny", "dtype float32", "device cpu", "tp=1 spp=2 kvp=1", "lars-mp"]
    parts += ["OnlineCostModel", "50.0 ms", "KV pool 2,048 tokens", "http://127.0.0.1:8000"]
    parts += ["decode steps: no CUDA graphs; async scheduling off"]
    for part in parts:
        assert part in text
    on_gpu = dataclasses.replace(info, cuda_graph_max_batch=256, async_scheduling=True)
    ready = dataclasses.replace(ready, info=on_gpu)
    text = "\n".join(startup_summary(ready, served_name="t", address="http://127.0.0.1:8000"))
    assert "decode steps: CUDA graphs for decode batches up to 256; async scheduling on" in text
    line = access_line(
        request_id="cmpl-1",
        route="/v1/completions",
        status=200,
        prompt_tokens=5,
        output_tokens=7,
        ttft_s=0.0123,
        e2e_s=0.5,
        finish="length",
    )
    assert line == (
        "cmpl-1 /v1/completions 200 prompt_tokens=5 output_tokens=7 ttft=12.3ms e2e=500.0ms "
        "finish=length"
    )


def test_summary_lists_the_generation_configs_sampling_defaults() -> None:
    info = _info()
    ready = EngineReady("m", 256, 1, "float32", "ParallelDegrees(tp=1, spp=1, kvp=1)", info)
    text = "\n".join(startup_summary(ready, served_name="m", address="http://x"))
    assert "generation config" not in text
    info = dataclasses.replace(info, sampling_defaults=(("temperature", 0.6), ("top_p", 0.9)))
    ready = dataclasses.replace(ready, info=info)
    text = "\n".join(startup_summary(ready, served_name="m", address="http://x"))
    assert "default sampling from the model's generation config: temperature=0.6, top_p=0.9" in text
