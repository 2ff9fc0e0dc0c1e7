"""The engine's liveness pulse keeps beating while a step blocks the engine loop."""

from __future__ import annotations

import pickle
import time

import pytest

from tests.server.conftest import start_server, stop_server

zmq = pytest.importorskip("zmq")
httpx = pytest.importorskip("httpx")


def test_pulse_beats_while_the_main_thread_is_busy(tmp_path) -> None:
    import torch

    from medha_runtime.server.engine_proc import Alive
    from medha_runtime.server.pulse import Pulse

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path / 'pulse'}"
    pull.bind(address)
    pulse = Pulse(ctx, address, Alive(), period_s=0.05)
    try:
        t0 = time.monotonic()
        a = torch.randn(256, 256)
        while time.monotonic() - t0 < 0.6:  # a busy "step": the loop never yields
            a = torch.tanh(a @ a)
        pulse.stop()
        got = []
        while pull.poll(200):
            got.append(pickle.loads(pull.recv()))
    finally:
        pulse.stop()
        pull.close(linger=0)
        ctx.term()
    assert len(got) >= 4 and all(isinstance(m, Alive) for m in got)


def test_one_long_step_does_not_kill_the_engine(monkeypatch) -> None:
    # One non-preemptive prefill of 12K tokens is a single step far longer
    # than the (lowered) liveness timeout; the engine must stay alive.
    monkeypatch.setenv("MEDHA_ENGINE_TIMEOUT_S", "0.5")
    flags = ["--policy", "fcfs", "--chunk-size", "0", "--max-model-len", "16384"]
    flags += [
        "--kv-cache-tokens",
        "16384",
        "--cost-model",
        "affine:base=0.01,per_token=1e-5,per_attn=0",
    ]
    server = start_server(*flags)
    try:
        body = {"model": "tiny", "prompt": [7] * 12_000, "max_tokens": 2, "ignore_eos": True}
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        assert took > 0.5  # the step really outlasted the timeout
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        stop_server(server)
