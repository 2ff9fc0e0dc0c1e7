"""Trace files: round trip, and errors that name the file, line number and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medha_sched.sim.trace import TraceError, TraceRequest, read_trace, write_trace

GOOD = {"id": "a", "arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 2}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    reqs = [
        TraceRequest("a", 0.0, 10, 2),
        TraceRequest("b", 1.25, 300, 1, ttft_slo_s=2.0, tpot_slo_s=0.05, priority=-1),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == 2
    assert read_trace(path) == reqs


def test_blank_lines_and_unknown_keys_are_ignored(tmp_path: Path) -> None:
    extra = {**GOOD, "note": "kept out"}
    path = write_lines(tmp_path / "t.jsonl", ["", json.dumps(extra), "   "])
    assert read_trace(path) == [TraceRequest("a", 0.5, 10, 2)]


def test_integral_floats_are_token_counts(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps({**GOOD, "prompt_tokens": 12.0})])
    (r,) = read_trace(path)
    assert r.prompt_tokens == 12 and isinstance(r.prompt_tokens, int)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt_tokens": 0}, "line 3: prompt_tokens must be an integer >= 1, got 0"),
        ({"prompt_tokens": 2.5}, "line 3: prompt_tokens must be an integer >= 1, got 2.5"),
        ({"output_tokens": True}, "line 3: output_tokens must be an integer >= 1, got True"),
        ({"output_tokens": "4"}, "line 3: output_tokens must be an integer >= 1, got '4'"),
        ({"arrival_s": -1}, "line 3: arrival_s must be a finite number >= 0, got -1"),
        ({"arrival_s": "soon"}, "line 3: arrival_s must be a finite number >= 0, got 'soon'"),
        ({"id": 7}, "line 3: id must be a non-empty string, got 7"),
        ({"id": ""}, "line 3: id must be a non-empty string, got ''"),
        ({"ttft_slo_s": 0}, "line 3: ttft_slo_s must be a finite number > 0, got 0"),
        ({"tpot_slo_s": -0.1}, "line 3: tpot_slo_s must be a finite number > 0, got -0.1"),
        ({"priority": 1.5}, "line 3: priority must be an integer, got 1.5"),
    ],
)
def test_bad_field_names_file_line_and_field(tmp_path: Path, change: dict, message: str) -> None:
    bad = json.dumps({**GOOD, "id": "c", **change})
    ok = [json.dumps(GOOD), json.dumps({**GOOD, "id": "b"})]
    path = write_lines(tmp_path / "trace.jsonl", [*ok, bad, json.dumps({**GOOD, "id": "d"})])
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(err.value) == f"trace.jsonl {message}"


@pytest.mark.parametrize("field", ["id", "arrival_s", "prompt_tokens", "output_tokens"])
def test_missing_required_field(tmp_path: Path, field: str) -> None:
    line = {k: v for k, v in GOOD.items() if k != field}
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(line)])
    with pytest.raises(TraceError, match=f"^t.jsonl line 1: missing required field '{field}'$"):
        read_trace(path)


def test_invalid_json_names_the_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD), '{"id": "b", "arrival_s": 1,'])
    with pytest.raises(TraceError, match=r"^t.jsonl line 2: invalid JSON \("):
        read_trace(path)


def test_non_object_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", ["[1, 2]"])
    with pytest.raises(TraceError, match="line 1: expected a JSON object, got list"):
        read_trace(path)


def test_duplicate_id_names_both_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD), "", json.dumps(GOOD)])
    with pytest.raises(TraceError, match="line 3: id 'a' repeats the id of line 1"):
        read_trace(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")
