"""The JSON result of a run: its configuration, the summary and every request.

Layout::

    {"version": 1, "started_at": "...", "base_url": "...", "model": "...",
     "config": {...}, "summary": {"all": {...}, "short": {...}, "long": {...}},
     "server": {"prediction_error": {"steps", "mean", "p50", "p90",
                                     "median_last_100"} or null},
     "requests": [{"id", "kind", "prompt_tokens", "output_tokens", "arrival_s",
                   "start_s", "ttft_s", "tpot_s", "itl_s", "e2e_s", "error", ...}]}

Non-finite numbers are written as ``null`` so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from medha_runtime.bench.record import RequestRecord

RESULT_VERSION = 1


def result_document(
    *,
    config: Mapping[str, Any],
    base_url: str,
    model: str,
    started_at: str,
    summary: Mapping[str, Any],
    records: Sequence[RequestRecord],
    server: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``server``: what the server reported about the run (see ``server_metrics``)."""
    return {
        "version": RESULT_VERSION,
        "started_at": started_at,
        "base_url": base_url,
        "model": model,
        "config": dict(config),
        "summary": dict(summary),
        "server": dict(server or {}),
        "requests": [r.to_json() for r in records],
    }


def write_result(path: str | Path, document: Mapping[str, Any]) -> None:
    """Write ``document`` as indented strict JSON (creating the parent directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_finite(document), indent=1, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
