"""Start ``medha-runtime serve`` as a child process and wait until it answers.

For benchmarks and scripts that drive a real server (as vLLM's and SGLang's
test utilities do): a free loopback port, the server in its own session (so
its engine and worker processes can be signalled together), ``GET /health``
polled until it answers 200, and a stop that sends SIGTERM and, past a grace
period, SIGKILL to the whole session. Imports no torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx


class LaunchError(RuntimeError):
    """The server exited or did not become healthy in time."""


@dataclass(frozen=True, slots=True)
class ServerProcess:
    """A started server: its process and base URL (``http://127.0.0.1:PORT``)."""

    proc: subprocess.Popen
    url: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, flags: Sequence[str] = ()) -> list[str]:
    """``python -m medha_runtime serve MODEL --port PORT FLAGS...``."""
    return [sys.executable, "-m", "medha_runtime", "serve", model, "--port", str(port), *flags]


def start_server(
    model: str,
    flags: Sequence[str] = (),
    *,
    log: Path | IO[str] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 300.0,
) -> ServerProcess:
    """Start a server and wait for its health check.

    Args:
        model: the model name ``serve`` takes (``tiny``, ``smollm2``, a path).
        flags: further ``serve`` flags.
        log: a file (path or open text file) for its stdout and stderr; None
            leaves them on this process's.
        env: the child's whole environment (default: this process's).
        cwd: its working directory (default: this process's).
        timeout_s: how long to wait for ``/health``.

    Raises:
        LaunchError: the server exited, or was not healthy within ``timeout_s``
            (then it is stopped first).
    """
    port = free_port()
    out = log.open("w") if isinstance(log, Path) else log
    proc = subprocess.Popen(
        serve_command(model, port, flags),
        stdout=out,
        stderr=subprocess.STDOUT if out is not None else None,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
    )
    server = ServerProcess(proc, f"http://127.0.0.1:{port}")
    where = f"; see {log}" if isinstance(log, Path) else ""
    if not wait_healthy(server, timeout_s=timeout_s):
        code = proc.poll()
        stop_server(server)
        if code is not None:
            raise LaunchError(f"the server exited with code {code}{where}")
        raise LaunchError(f"the server was not healthy within {timeout_s:.0f} s{where}")
    return server


def wait_healthy(server: ServerProcess, *, timeout_s: float) -> bool:
    """Poll ``/health`` until 200 (True), the process exits or time runs out (False)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if server.proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def stop_server(server: ServerProcess, *, grace_s: float = 30.0) -> int | None:
    """SIGTERM, then SIGKILL to the server's session after ``grace_s``; its exit code."""
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode
