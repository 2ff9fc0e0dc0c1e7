"""The bench client's clock: TTFT at the first token's chunk, even when its text is empty."""

from __future__ import annotations

import pytest

from medha_runtime.bench import client as bench_client
from medha_runtime.bench.client import _Stream
from medha_runtime.bench.record import RequestRecord


def _feed(monkeypatch, events: list[tuple[float, dict]]) -> RequestRecord:
    record = RequestRecord(id="r", kind="short", prompt_tokens=5, max_tokens=3, arrival_s=0.0)
    stream = _Stream(start=10.0)
    for now, obj in events:
        monkeypatch.setattr(bench_client.time, "perf_counter", lambda now=now: now)
        stream.chunk(obj, record)
    stream.done = True
    stream.finish(record, now=10.5)
    return record


def test_first_token_counts_even_with_held_back_text(monkeypatch) -> None:
    record = _feed(
        monkeypatch,
        [
            (10.1, {"choices": [{"text": ""}]}),  # part of a character: held back
            (10.2, {"choices": [{"text": "é"}]}),
            (10.4, {"choices": [{"text": "!", "finish_reason": "length"}]}),
            (10.45, {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 5}}),
        ],
    )
    assert record.ttft_s == pytest.approx(0.1)
    assert record.itl_s == pytest.approx([0.1, 0.2])
    assert record.output_tokens == 3 and record.finish_reason == "length"
    assert record.tpot_s == pytest.approx((0.5 - 0.1) / 2)


def test_a_bare_finish_chunk_is_not_a_token(monkeypatch) -> None:
    record = _feed(
        monkeypatch,
        [
            (10.1, {"choices": [{"text": "a"}]}),
            (10.3, {"choices": [{"text": "", "finish_reason": "stop"}]}),
        ],
    )
    assert record.ttft_s == pytest.approx(0.1)
    assert record.itl_s == [] and record.output_tokens == 1  # counted from chunks, no usage
    assert record.finish_reason == "stop"
