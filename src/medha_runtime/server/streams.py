"""One HTTP request's engine requests: submit them, follow their deltas, abort them.

A :class:`Run` holds one :class:`Sub` per engine request (``n`` samples of
each prompt), all feeding one asyncio queue. A watcher task waits on the
ASGI ``receive`` channel for ``http.disconnect`` and puts
:data:`DISCONNECTED` on the queue, so a client that leaves is seen at once,
streaming or not; every unfinished engine request is then aborted (each one
counts in ``medha:request_success{finished_reason="abort"}``). When the run
ends it writes one access line (:mod:`medha_runtime.server.logs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from medha_runtime.server.client import Accepted, EngineClient, Failure
from medha_runtime.server.messages import AddRequest, RequestDelta
from medha_runtime.server.metrics import ServerMetrics
from medha_runtime.server.protocol import APIError

#: put on a run's queue when its client disconnected
DISCONNECTED = object()


@dataclass
class Sub:
    """One engine request (one choice) as it runs."""

    request_id: str
    index: int  # the choice's index
    prompt_index: int
    prompt_ids: list[int]
    prompt_text: str | None
    arrival: float
    last: float | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    #: per token, the text it added to ``text`` (a delta's text is its last token's)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_first: bool = False
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    emitted: int = 0  # characters streamed so far (echoed prompt included)
    refused: bool = False  # the engine refused it: it never ran, nothing to abort

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its text (None for token ids) and token ids."""

    text: str | None
    ids: list[int]


def _without_output(delta: RequestDelta) -> RequestDelta:
    """``delta`` with no generated tokens; a normal end (a stop or the length) is
    "length": nothing was to be generated."""
    reason, stop = delta.finish_reason, delta.stop_reason
    if reason in ("stop", "length"):
        reason, stop = "length", None
    return dataclasses.replace(
        delta, new_token_ids=[], new_text="", logprobs=None, finish_reason=reason,
        stop_reason=stop, num_output_tokens=0,
    )  # fmt: skip


class Run:
    """The engine requests of one HTTP request (see the module docstring).

    ``access``: called once at the end with ``(run, status)``.
    """

    def __init__(
        self,
        client: EngineClient,
        metrics: ServerMetrics,
        *,
        route: str,
        prefix: str,
        access: Callable[[Run, int], None],
    ) -> None:
        self.client, self.metrics, self.route = client, metrics, route
        self.access = access
        self.base = uuid.uuid4().hex
        self.id = f"{prefix}{self.base}"
        self.subs: list[Sub] = []
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.disconnected = False
        self._watcher: asyncio.Task[None] | None = None
        self._done = False
        self._early: list[Any] = []  # deltas read while waiting for the engine's accept
        #: scoring a prompt (``echo`` with ``max_tokens: 0``): the one token the engine
        #: ran is dropped from every delta, and a request that ended ends with "length"
        self.drop_output = False

    # ------------------------------------------------------------ submission
    async def submit(self, prompts: list[Prompt], n: int, make: Callable[[int, Sub], Any]) -> None:
        """Start ``n`` engine requests per prompt; ``make(i, sub)`` builds sample ``i``'s
        :class:`AddRequest` fields (a dict)."""
        now = self.arrival
        for p_index, p in enumerate(prompts):
            for i in range(n):
                index = p_index * n + i
                sub = Sub(f"{self.base}-{index}", index, p_index, p.ids, p.text, now)
                self.subs.append(sub)
                msg = AddRequest(sub.request_id, p.ids, prompt=p.text, **make(i, sub))
                try:
                    await self.client.add(msg, self.queue, len(self.subs) - 1)
                except Exception as exc:
                    self.abort()
                    raise APIError(f"the engine is not available: {exc}", 503) from None

    def watch(self, receive: Callable[[], Any]) -> None:
        """Watch the ASGI ``receive`` channel for the client's disconnect."""

        async def wait() -> None:
            while True:
                message = await receive()
                if message.get("type") == "http.disconnect":
                    self.queue.put_nowait(DISCONNECTED)
                    return

        self._watcher = asyncio.get_running_loop().create_task(wait())

    async def accepted(self) -> None:
        """Wait until the engine took every sub (submitted with ``ack``): its
        ``Accepted``, or any delta of it, which is kept for :meth:`deltas`. A stream
        waits here before its 200 headers, so that a refusal is a plain error answer;
        the first token comes after the accept on the same socket, so no later.

        Raises :class:`APIError` when the engine refused a sub (or failed); returns
        early (with :attr:`disconnected` set) when the client left.
        """
        waiting = set(range(len(self.subs)))
        while waiting:
            item = await self.queue.get()
            if self._ends(item):
                return
            if isinstance(item, Accepted):
                waiting.discard(item.index)
            else:
                waiting.discard(item[0])
                self._early.append(item)

    def _ends(self, item: Any) -> bool:
        """Whether ``item`` is the client's disconnect (noted in :attr:`disconnected`);
        raises the :class:`APIError` of a :class:`Failure`."""
        if item is DISCONNECTED:
            self.disconnected = True
            return True
        if isinstance(item, Failure):
            raise self._refused(item)
        return False

    def _refused(self, failure: Failure) -> APIError:
        if failure.index is not None:
            self.subs[failure.index].refused = True
        return APIError(failure.message, 400 if failure.bad_request else 503)

    # ------------------------------------------------------------- following
    def record(self, sub: Sub, delta: RequestDelta, now: float) -> None:
        m = self.metrics
        k = len(delta.new_token_ids)
        if k:
            if sub.last is None:
                m.ttft.observe(now - sub.arrival)
                for _ in range(k - 1):
                    m.itl.observe(0.0)
                if self.first_token is None:
                    self.first_token = now
            else:
                gap = (now - sub.last) / k
                for _ in range(k):
                    m.itl.observe(gap)
            sub.last = now
            m.generation_tokens.inc(k)
        if delta.deadline_met is True:
            m.deadline_met.inc()
        elif delta.deadline_met is False:
            m.deadline_missed.inc()
        if delta.prompt_logprobs is not None:
            sub.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens:
            sub.cached_tokens = delta.num_cached_tokens
        sub.tokens.extend(delta.new_token_ids)
        sub.text += delta.new_text
        if k:
            sub.pieces += [""] * (k - 1) + [delta.new_text]
        elif sub.pieces:  # text held back until the end, with no token of its own
            sub.pieces[-1] += delta.new_text
        if delta.logprobs:
            sub.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            sub.finish_reason, sub.stop_reason = delta.finish_reason, delta.stop_reason
            m.e2e.observe(now - sub.arrival)
            m.prompt_tokens.inc(sub.num_prompt_tokens)
            if delta.finish_reason in m.success:
                m.success[delta.finish_reason].inc()

    async def deltas(self) -> AsyncIterator[tuple[Sub, RequestDelta, int]]:
        """``(sub, delta, tokens before it)`` until every sub finished.

        Raises :class:`APIError` when the engine fails a request; returns early
        (with :attr:`disconnected` set) when the client left.
        """
        left = sum(1 for s in self.subs if s.finish_reason is None)
        while left and not self.disconnected:
            item = self._early.pop(0) if self._early else await self.queue.get()
            if self._ends(item):
                return
            if isinstance(item, Accepted):
                continue
            idx, delta, now = item
            if self.drop_output:
                delta = _without_output(delta)
            sub = self.subs[idx]
            before = len(sub.tokens)
            self.record(sub, delta, now)
            if delta.error is not None:  # the engine failed this request (500) or the step
                raise APIError(delta.error, 500 if delta.finish_reason == "error" else 503)
            if delta.finish_reason is not None:
                left -= 1
            yield sub, delta, before

    async def collect(self) -> None:
        """Wait until every sub finished (or the client left)."""
        async for _ in self.deltas():
            pass

    # ------------------------------------------------------------------ end
    def abort(self) -> None:
        """Abort every unfinished engine request (each counts as an abort; one the
        engine refused never ran and counts as none)."""
        for s in self.subs:
            if s.finish_reason is None and not s.refused:
                s.finish_reason = "abort"
                self.metrics.success["abort"].inc()
                self.client.abort_soon(s.request_id)

    def finish(self, status: int) -> None:
        """End the run: stop watching, abort what is left, write the access line (once)."""
        if self._done:
            return
        self._done = True
        if self._watcher is not None:
            self._watcher.cancel()
        self.abort()
        self.access(self, 499 if self.disconnected else status)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens as OpenAI counts them: each prompt once, whatever ``n``."""
        seen: dict[int, int] = {}
        for s in self.subs:
            seen[s.prompt_index] = s.num_prompt_tokens
        return sum(seen.values())

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache: each prompt once (its first run)."""
        seen: dict[int, int] = {}
        for s in self.subs:
            seen.setdefault(s.prompt_index, s.cached_tokens)
        return sum(seen.values())

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.subs)
