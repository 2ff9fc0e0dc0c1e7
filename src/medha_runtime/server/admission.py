"""Predictive admission in the HTTP process: 429 for requests that cannot meet their TTFT SLO.

With ``--admission reject`` the engine process attaches a queue snapshot
(:class:`~medha_sched.admission.QueueSnapshot`) to its heartbeats; the
:class:`AdmissionGate` keeps the latest one and, for every prompt of a request
with ``ttft_slo_ms``, predicts its TTFT right here (no round trip to the
engine). A request predicted to miss gets HTTP 429 with an OpenAI-shaped error
body (``type: "RateLimitError"``, plus ``predicted_ttft_ms`` and
``ttft_slo_ms``) and a ``Retry-After`` header in whole seconds. Requests
without an SLO are always accepted.

How fast a 429 goes out is measured here too: :class:`Arrival` stamps each
HTTP request as it enters the ASGI app (before its body is read and parsed),
and ``medha:admission_reject_seconds`` observes the time from that stamp to
the moment the 429 response has been handed to the server's transport.
"""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from medha_runtime.server.protocol import error_body
from medha_sched.admission import AdmissionController

#: the key in the ASGI scope's ``state`` under which :class:`Arrival` puts the arrival time
ARRIVAL_KEY = "medha_arrival"


class Arrival:
    """Pure ASGI middleware: stamp each HTTP request with ``time.monotonic()`` as it
    enters the app (``scope["state"][ARRIVAL_KEY]``, read as ``request.state``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVAL_KEY] = time.monotonic()
        await self.app(scope, receive, send)


class _Rejection(JSONResponse):
    """The 429 response; once sent, ``on_sent()`` runs (it observes the latency)."""

    def __init__(self, *args: Any, on_sent: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_sent = on_sent

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)
        self._on_sent()


class AdmissionRejected(Exception):
    """A request predicted to miss its TTFT SLO."""

    def __init__(self, predicted_s: float, slo_s: float, retry_after_s: float) -> None:
        super().__init__(
            f"the request cannot meet its TTFT SLO of {slo_s * 1e3:.0f} ms: predicted time "
            f"to first token is {predicted_s * 1e3:.0f} ms under the current load; retry later"
        )
        self.predicted_s, self.slo_s, self.retry_after_s = predicted_s, slo_s, retry_after_s


class AdmissionGate:
    """Decides at arrival; ``reject=False`` makes it accept everything (no snapshots come)."""

    def __init__(self, *, reject: bool) -> None:
        self.enabled = reject
        self.controller = AdmissionController(reject=reject)

    def install(self, app: FastAPI, client: Any, metrics: Any) -> None:
        """Follow the engine's heartbeats and answer :class:`AdmissionRejected` with 429
        (timed from :class:`Arrival`, installed here as the outermost middleware)."""
        if not self.enabled:
            return
        app.add_middleware(Arrival)

        def on_beat(beat: Any) -> None:
            if beat.queue is not None:
                self.controller.update(beat.queue)

        client.on_heartbeat.append(on_beat)

        @app.exception_handler(AdmissionRejected)
        async def _rejected(request: Request, exc: AdmissionRejected) -> JSONResponse:
            metrics.admission_rejected.inc()
            body = error_body(str(exc), "RateLimitError", 429)
            body["error"]["predicted_ttft_ms"] = round(exc.predicted_s * 1e3, 3)
            body["error"]["ttft_slo_ms"] = round(exc.slo_s * 1e3, 3)
            retry = str(max(1, math.ceil(exc.retry_after_s)))
            arrival = request.scope.get("state", {}).get(ARRIVAL_KEY)

            def sent() -> None:
                if arrival is not None:
                    metrics.admission_reject_seconds.observe(time.monotonic() - arrival)

            return _Rejection(body, 429, headers={"Retry-After": retry}, on_sent=sent)

    def check(self, ttft_slo_ms: float | None, prompt_lengths: list[int]) -> None:
        """Raise :class:`AdmissionRejected` if any prompt is predicted to miss the SLO."""
        if not self.enabled or ttft_slo_ms is None:
            return
        slo = ttft_slo_ms / 1e3
        now = time.monotonic()
        for n in prompt_lengths:
            verdict = self.controller.decide(n, slo, now)
            if not verdict.accept:
                assert verdict.predicted_ttft is not None
                raise AdmissionRejected(verdict.predicted_ttft, slo, verdict.retry_after)
