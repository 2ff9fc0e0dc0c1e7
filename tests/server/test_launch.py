"""``medha_runtime.server.launch``: a server that cannot start is an error naming its exit."""

from __future__ import annotations

import time

import pytest

from medha_runtime.server.launch import LaunchError, free_port, serve_command, start_server


def test_serve_command_and_free_port() -> None:
    port = free_port()
    assert 0 < port < 65536
    cmd = serve_command("tiny", port, ["--log-level", "warning"])
    assert cmd[1:] == ["-m", "medha_runtime", "serve", "tiny", "--port", str(port),
                       "--log-level", "warning"]  # fmt: skip


def test_a_server_that_exits_is_a_launch_error(tmp_path) -> None:
    log = tmp_path / "server.log"
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"exited with code 2; see .*server\.log"):
        start_server("tiny", ["--max-model-len", "-3"], log=log, timeout_s=60)
    assert time.monotonic() - t0 < 60  # noticed the exit, did not wait out the timeout
    assert "max-model-len" in log.read_text()
