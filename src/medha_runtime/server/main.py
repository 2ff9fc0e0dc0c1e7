"""Start the server: check what fails at once, then the app (which starts the engine), uvicorn.

Start-up errors come first, as one line each, before the engine starts: the
port is bound here (a port in use fails within a second) and ``--device
cuda`` is checked against the machine's NVIDIA devices.

SIGINT and SIGTERM abort every in-flight request at once (non-streaming ones
get a 503, streams an error event), then uvicorn stops accepting
connections and the app's lifespan stops the engine process (which shuts its
workers down): the process exits 0 within seconds, without a traceback.

If the engine dies (or one of its workers does), pending requests get an
error at once, new ones get 503 for ``exit_after_engine_death_s``, then the
server stops and :func:`run_server` raises :class:`EngineDeadError` (the CLI
prints it and exits with code 1) so a supervisor can restart it.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from typing import Any

from medha_runtime.server.app import ServerConfig, build_app
from medha_runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES
from medha_runtime.server.client import EngineDeadError
from medha_runtime.server.cors import CorsConfig
from medha_runtime.server.engine_proc import EngineArgs
from medha_runtime.server.logs import setup_logging
from medha_runtime.server.startup import bind_socket, check_device


def run_server(
    engine: EngineArgs,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    log_requests: bool = True,
    graceful_s: float = 3.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    exit_after_engine_death_s: float | None = 2.0,
    stats_interval_s: float = 10.0,
    sock: socket.socket | None = None,
    cors: CorsConfig | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM. ``sock``: a socket :func:`bind_socket` made (the
    command line binds it before it imports the server); else ``host:port`` is bound.
    ``cors``: what cross-origin requests may do (default: :class:`CorsConfig`'s)."""
    import uvicorn

    setup_logging(log_level)
    check_device(engine.engine.device)
    if sock is None:
        sock = bind_socket(host, port)
    config = ServerConfig(
        engine=engine,
        served_model_name=served_model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        exit_after_engine_death_s=exit_after_engine_death_s,
        log_requests=log_requests,
        stats_interval_s=stats_interval_s,
        address=f"http://{host}:{sock.getsockname()[1]}",
        cors=cors or CorsConfig(),
    )
    app = build_app(config)
    server = _Server(
        uvicorn.Config(
            app,
            log_level=log_level,
            timeout_graceful_shutdown=graceful_s,
            access_log=False,
        ),
        app,
    )
    app.state.request_exit = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises Ctrl-C once it stopped; uvicorn.run swallows it, so do we
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    sock.close()
    if app.state.start_error is not None:
        raise EngineDeadError(app.state.start_error)
    if not server.started:
        sys.exit(3)  # what uvicorn.run does when start-up fails (the log says why)
    dead = app.state.client.dead
    if dead is not None:
        raise EngineDeadError(
            f"the engine died ({dead}); the server stopped so that it can be restarted"
        )


def _uvicorn_server() -> Any:
    import uvicorn

    return uvicorn.Server


class _Server(_uvicorn_server()):  # type: ignore[misc]
    """uvicorn's server, plus: the first SIGINT/SIGTERM ends every in-flight request."""

    def __init__(self, config: Any, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once it stopped (exit status -15 for
        # SIGTERM); this server handles it and exits 0
        self._captured_signals.clear()
        # a plain flag, safe from a signal handler: it also covers a signal that
        # comes before the lifespan has started the engine (no loop yet)
        self._app.state.client.start_cancelled = True
        loop = getattr(self._app.state, "loop", None)
        if first and loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._app.state.on_signal)
