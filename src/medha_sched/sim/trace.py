"""Request traces: JSONL, one request per line.

Each line is a JSON object::

    {"id": "r0", "arrival_s": 0.25, "prompt_tokens": 1730, "output_tokens": 415}

Required: ``id`` (non-empty string, unique in the file), ``arrival_s``
(finite number >= 0, seconds), ``prompt_tokens`` and ``output_tokens``
(integers >= 1). Optional: ``ttft_slo_s`` and ``tpot_slo_s`` (numbers > 0,
seconds; without ``ttft_slo_s`` the scheduler derives the deadline) and
``priority`` (integer, lower is served first); ``prefix_id`` (non-empty
string) with ``prefix_tokens`` (integer, 0 to ``prompt_tokens``): the
prompt's first ``prefix_tokens`` tokens are those of a token stream shared
by every request naming ``prefix_id`` (a document, a repository, a chat
session's history), so the simulated prefix cache can reuse their KV.
Other keys are ignored, so a trace may carry annotations. Blank lines are
skipped. Lines need not be in arrival order.

Any bad line raises :class:`TraceError` naming the file, the line number and
the field, e.g. ``trace.jsonl line 7: prompt_tokens must be an integer >= 1,
got 0``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace (lengths and timing only; no token ids).

    Attributes:
        id: unique request id.
        arrival_s: arrival time in seconds from the start of the trace.
        prompt_tokens: prompt length.
        output_tokens: tokens to generate (the request always runs to this length).
        ttft_slo_s: TTFT deadline relative to arrival, or ``None`` to derive it.
        tpot_slo_s: per-output-token latency target, or ``None``.
        priority: strict class; lower numbers are served first.
        prefix_id: the shared token stream the prompt starts with, or ``None``.
        prefix_tokens: how many of the prompt's first tokens come from it.
    """

    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0
    prefix_id: str | None = None
    prefix_tokens: int = 0

    def to_json(self) -> dict[str, object]:
        """The trace line as a dict; optional fields only when set."""
        line: dict[str, object] = {
            "id": self.id,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }
        if self.ttft_slo_s is not None:
            line["ttft_slo_s"] = self.ttft_slo_s
        if self.tpot_slo_s is not None:
            line["tpot_slo_s"] = self.tpot_slo_s
        if self.priority:
            line["priority"] = self.priority
        if self.prefix_id is not None:
            line["prefix_id"] = self.prefix_id
            line["prefix_tokens"] = self.prefix_tokens
        return line


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Parse a JSONL trace; raises :class:`TraceError` on the first bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    requests: list[TraceRequest] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        request = parse_line(line, where=f"{path.name} line {lineno}")
        first = seen.setdefault(request.id, lineno)
        if first != lineno:
            raise TraceError(
                f"{path.name} line {lineno}: id {request.id!r} repeats the id of line {first}"
            )
        requests.append(request)
    return requests


def parse_line(line: str, *, where: str = "trace line") -> TraceRequest:
    """One trace line; ``where`` prefixes every error message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("id", "arrival_s", "prompt_tokens", "output_tokens"):
        if key not in obj:
            raise TraceError(f"{where}: missing required field {key!r}")
    rid = obj["id"]
    if not isinstance(rid, str) or not rid:
        raise TraceError(f"{where}: id must be a non-empty string, got {rid!r}")
    prompt_tokens = _count(obj, "prompt_tokens", where)
    prefix_id, prefix_tokens = _prefix(obj, where, prompt_tokens)
    return TraceRequest(
        id=rid,
        arrival_s=_number(obj, "arrival_s", where, minimum=0.0, strict=False),
        prompt_tokens=prompt_tokens,
        output_tokens=_count(obj, "output_tokens", where),
        ttft_slo_s=_optional_number(obj, "ttft_slo_s", where),
        tpot_slo_s=_optional_number(obj, "tpot_slo_s", where),
        priority=_priority(obj, where),
        prefix_id=prefix_id,
        prefix_tokens=prefix_tokens,
    )


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` as JSONL; returns the number of lines written."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(obj: dict, key: str, where: str, *, minimum: float, strict: bool) -> float:
    value = obj[key]
    ok = _is_number(value) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        op = ">" if strict else ">="
        raise TraceError(f"{where}: {key} must be a finite number {op} {minimum:g}, got {value!r}")
    return float(value)


def _optional_number(obj: dict, key: str, where: str) -> float | None:
    if obj.get(key) is None:
        return None
    return _number(obj, key, where, minimum=0.0, strict=True)


def _count(obj: dict, key: str, where: str) -> int:
    value = obj[key]
    # JSON has one number type: accept 12.0 as 12, but not 12.5 or true.
    if _is_number(value) and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TraceError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def _prefix(obj: dict, where: str, prompt_tokens: int) -> tuple[str | None, int]:
    prefix_id, tokens = obj.get("prefix_id"), obj.get("prefix_tokens")
    if prefix_id is None and tokens is None:
        return None, 0
    if prefix_id is None or tokens is None:
        have, missing = ("prefix_id", "prefix_tokens")
        if prefix_id is None:
            have, missing = missing, have
        raise TraceError(f"{where}: {have} needs {missing} too")
    if not isinstance(prefix_id, str) or not prefix_id:
        raise TraceError(f"{where}: prefix_id must be a non-empty string, got {prefix_id!r}")
    if _is_number(tokens) and isinstance(tokens, float) and tokens.is_integer():
        tokens = int(tokens)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= prompt_tokens:
        raise TraceError(
            f"{where}: prefix_tokens must be an integer from 0 to prompt_tokens "
            f"({prompt_tokens}), got {tokens!r}"
        )
    return prefix_id, tokens


def _priority(obj: dict, where: str) -> int:
    value = obj.get("priority", 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceError(f"{where}: priority must be an integer, got {value!r}")
    return value
