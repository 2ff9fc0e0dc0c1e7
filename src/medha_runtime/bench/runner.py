"""Send prepared requests at their arrival times (asyncio), at most N in flight, with progress.

Each request starts its own task when its offset comes, whether or not the
earlier ones finished (an open-loop load, as vLLM's benchmark); under
``max_concurrency`` a task waits for a slot before sending, and its TTFT counts
from the send. Every request ends with a record: completed, failed (with the
reason), or, if the run is interrupted, marked as not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from medha_runtime.bench.client import request_body, send
from medha_runtime.bench.prompts import PreparedRequest
from medha_runtime.bench.record import RequestRecord


class Runner:
    """One benchmark run; ``records`` holds every request's outcome, even after an interrupt.

    Args:
        requests: what to send, in order.
        offsets: send time of each request, seconds from the start.
        url: the completions endpoint.
        base_body: fields every request carries (model, stream, ...).
        headers: HTTP headers (authorization).
        slo_fields: send each request's SLOs and priority.
        max_concurrency: at most this many requests in flight (``None``: no limit).
        timeout_s: limit on one request, send to last chunk.
        progress: show a tqdm bar on stderr.
    """

    def __init__(
        self,
        requests: Sequence[PreparedRequest],
        offsets: Sequence[float],
        *,
        url: str,
        base_body: dict[str, Any],
        headers: dict[str, str],
        slo_fields: bool = True,
        max_concurrency: int | None = None,
        timeout_s: float = 600.0,
        progress: bool = True,
    ) -> None:
        if len(requests) != len(offsets):
            raise ValueError(f"{len(requests)} requests but {len(offsets)} arrival offsets")
        self.bodies = [request_body(r, base_body, slo_fields=slo_fields) for r in requests]
        self.records = [_record(r, t) for r, t in zip(requests, offsets, strict=True)]
        self.finished = [False] * len(requests)
        self.url, self.headers = url, headers
        self.max_concurrency, self.timeout_s, self.progress = max_concurrency, timeout_s, progress
        self.duration_s = 0.0
        self.stopping = False
        self._t0 = 0.0

    async def run(self) -> list[RequestRecord]:
        """Send everything and wait for the last answer."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.timeout_s)
        client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=self.headers)
        tasks: list[asyncio.Task[None]] = []
        async with client:
            with _bar(len(self.records), self.progress) as bar:
                try:
                    await self._launch(client, bar, tasks)
                    await asyncio.gather(*tasks)
                except asyncio.CancelledError:  # Ctrl-C: stop the requests before closing
                    self.stopping = True
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
        return self.records

    async def _launch(
        self, client: httpx.AsyncClient, bar: Any, tasks: list[asyncio.Task[None]]
    ) -> None:
        """Start one task per request at its arrival time."""
        sem = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        self._t0 = time.perf_counter()
        for i, record in enumerate(self.records):
            delay = self._t0 + record.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._one(client, sem, i, bar)))

    async def _one(
        self, client: httpx.AsyncClient, sem: asyncio.Semaphore | None, i: int, bar: Any
    ) -> None:
        record = self.records[i]
        async with sem or contextlib.nullcontext():
            record.start_s = time.perf_counter() - self._t0
            try:
                sending = send(client, self.url, self.bodies[i], record)
                await asyncio.wait_for(sending, self.timeout_s)
            except asyncio.TimeoutError:
                record.error = f"no complete answer within {self.timeout_s:g} s"
            except Exception as exc:  # recorded, never lost
                record.error = f"unexpected {type(exc).__name__}: {exc}"
        self.finished[i] = not self.stopping
        self.duration_s = max(self.duration_s, time.perf_counter() - self._t0)
        bar.update(1)

    def mark_unfinished(self, reason: str = "interrupted before it finished") -> int:
        """Give every request still running or not yet sent an error; returns how many."""
        n = 0
        for record, done in zip(self.records, self.finished, strict=True):
            if not done:
                record.error, n = reason, n + 1
        if self._t0:
            self.duration_s = max(self.duration_s, time.perf_counter() - self._t0)
        return n


def _record(r: PreparedRequest, offset: float) -> RequestRecord:
    return RequestRecord(
        id=r.id,
        kind=r.kind,
        prompt_tokens=r.prompt_tokens,
        max_tokens=r.max_tokens,
        arrival_s=offset,
        ttft_slo_s=r.ttft_slo_s,
        tpot_slo_s=r.tpot_slo_s,
    )


def _bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, unit="req", desc="bench", file=sys.stderr, disable=not enabled, leave=False
    )
