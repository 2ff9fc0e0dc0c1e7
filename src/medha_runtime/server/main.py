"""Start the server: build the app (which starts the engine process) and run uvicorn.

uvicorn handles SIGINT and SIGTERM: it stops accepting connections, gives
in-flight requests ``graceful_s`` to finish, then the app's lifespan stops the
engine process (which shuts its workers down); requests still pending get an
error.

If the engine dies (or one of its workers does), pending requests get an
error at once, new ones get 503 for ``exit_after_engine_death_s``, then the
server stops and :func:`run_server` raises :class:`EngineDeadError` (the CLI
prints it and exits with code 1) so a supervisor can restart it.
"""

from __future__ import annotations

import contextlib
import sys

from medha_runtime.server.app import ServerConfig, build_app
from medha_runtime.server.body_limit import DEFAULT_MAX_BODY_BYTES
from medha_runtime.server.client import EngineDeadError
from medha_runtime.server.engine_proc import EngineArgs


def run_server(
    engine: EngineArgs,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    graceful_s: float = 5.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    exit_after_engine_death_s: float | None = 2.0,
) -> None:
    import uvicorn

    config = ServerConfig(
        engine=engine,
        served_model_name=served_model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        exit_after_engine_death_s=exit_after_engine_death_s,
    )
    app = build_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=graceful_s,
            access_log=False,
        )
    )
    app.state.request_exit = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises Ctrl-C once it stopped; uvicorn.run swallows it, so do we
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if app.state.start_error is not None:
        raise EngineDeadError(app.state.start_error)
    if not server.started:
        sys.exit(3)  # what uvicorn.run does when start-up fails (the log says why)
    dead = app.state.client.dead
    if dead is not None:
        raise EngineDeadError(
            f"the engine died ({dead}); the server stopped so that it can be restarted"
        )
