"""Start the server: build the app (which starts the engine process) and run uvicorn.

uvicorn handles SIGINT and SIGTERM: it stops accepting connections, gives
in-flight requests ``graceful_s`` to finish, then the app's lifespan stops the
engine process (which shuts its workers down); requests still pending get an
error.
"""

from __future__ import annotations

from medha_runtime.server.app import ServerConfig, build_app
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
) -> None:
    import uvicorn

    app = build_app(ServerConfig(engine, served_model_name=served_model_name, api_key=api_key))
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_s,
        access_log=False,
    )
