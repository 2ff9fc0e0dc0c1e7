"""What the benchmark measured for one request."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome; filled in as its stream arrives (times in seconds).

    Attributes:
        id, kind: the request and its class (``short``/``long``).
        prompt_tokens: the server's count (``usage``) when reported, else the prepared length.
        max_tokens: output length asked for.
        arrival_s: scheduled send time from the start of the run.
        start_s: actual send time from the start (later under ``--max-concurrency``).
        output_tokens: the server's ``usage.completion_tokens``, else token chunks counted.
        ttft_s: send to the first chunk with a choice (the first token, its text
            possibly held back).
        tpot_s: ``(e2e - ttft) / (output_tokens - 1)``; ``None`` for one token.
        itl_s: gaps between successive token chunks.
        e2e_s: send to the end of the stream.
        finish_reason: the server's, from the last choice that had one.
        ttft_slo_s, tpot_slo_s: the request's own SLOs (from a trace), if any.
        error: why the request failed (``None``: it completed).
    """

    id: str
    kind: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    start_s: float | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    finish_reason: str | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
