"""Start ``medha-runtime serve tiny`` in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("zmq")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def start_server(
    *extra: str,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    model: str = "tiny",
    env: dict[str, str] | None = None,
    stderr: int | None = None,
    log_level: str = "warning",
) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "medha_runtime", "serve", model, "--port", str(port)]
    cmd += ["--max-model-len", "256", "--kv-cache-tokens", "2048", "--log-level", log_level]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(extra)
    proc = subprocess.Popen(
        cmd, start_new_session=True, env={**os.environ, **(env or {})}, stderr=stderr
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return Server(proc, url, api_key)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(Server(proc, url, api_key))
    raise RuntimeError("the server did not become healthy in time")


def openai_client(server: Server, timeout: float = 60.0) -> object:
    """The ``openai`` client of ``server`` (its API key, if any; no retries)."""
    import openai

    key = server.api_key or "none"
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=timeout, max_retries=0)


def stop_server(server: Server) -> None:
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server(api_key=API_KEY)
    try:
        yield s
    finally:
        stop_server(s)
