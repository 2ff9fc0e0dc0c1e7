"""The simulator's prefix cache: trace fields, multi-turn sessions, hits."""

from __future__ import annotations

import json

import pytest

from medha_sched.sim.runner import OptionError, RunSpec, run_to_dir
from medha_sched.sim.trace import TraceError, TraceRequest, parse_line
from medha_sched.sim.workload import SessionSpec, generate_sessions


def test_trace_lines_carry_a_shared_prefix() -> None:
    r = parse_line(
        '{"id":"a","arrival_s":0,"prompt_tokens":100,"output_tokens":2,'
        '"prefix_id":"doc","prefix_tokens":80}'
    )
    assert (r.prefix_id, r.prefix_tokens) == ("doc", 80)
    assert parse_line(json.dumps(r.to_json())) == r
    plain = TraceRequest("b", 0.0, 10, 1)
    assert "prefix_id" not in plain.to_json()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('"prefix_id":"doc"', "prefix_id needs prefix_tokens too"),
        ('"prefix_tokens":5', "prefix_tokens needs prefix_id too"),
        ('"prefix_id":"","prefix_tokens":5', "prefix_id must be a non-empty string"),
        ('"prefix_id":"d","prefix_tokens":101', "prefix_tokens must be an integer from 0"),
    ],
)
def test_bad_prefix_fields_name_the_field(extra: str, message: str) -> None:
    line = '{"id":"a","arrival_s":0,"prompt_tokens":100,"output_tokens":2,' + extra + "}"
    with pytest.raises(TraceError, match=message):
        parse_line(line, where="t.jsonl line 3")


def test_sessions_resend_the_conversation_so_far() -> None:
    spec = SessionSpec(
        num_sessions=3, turns=3, qps=1.0, doc_tokens=1000, output_tokens=20, think_s=5.0
    )
    trace = generate_sessions(spec)
    assert trace == generate_sessions(spec) and len(trace) == 9
    s0 = sorted((r for r in trace if r.prefix_id == "s0"), key=lambda r: r.arrival_s)
    assert [r.prompt_tokens for r in s0] == [1064, 1148, 1232]  # + answer + question
    assert all(r.prefix_tokens == r.prompt_tokens for r in s0)
    with pytest.raises(ValueError, match="turns must be an integer >= 1"):
        SessionSpec(num_sessions=1, turns=0, qps=1.0)


def test_later_turns_hit_the_cache_in_the_simulator(tmp_path) -> None:
    trace = generate_sessions(
        SessionSpec(num_sessions=2, turns=3, qps=1.0, doc_tokens=4000, output_tokens=8)
    )
    on = run_to_dir(
        trace,
        RunSpec(
            cost_model="affine:base=1e-3,per_token=1e-5,per_attn=1e-9", kv_cache_tokens=1 << 16
        ),
        tmp_path / "on",
    )
    off = run_to_dir(
        trace,
        RunSpec(
            cost_model="affine:base=1e-3,per_token=1e-5,per_attn=1e-9",
            kv_cache_tokens=1 << 16,
            prefix_caching=False,
        ),
        tmp_path / "off",
    )
    hits = on["prefix_cache"]["hit_tokens"]
    later = sum(r.prompt_tokens for r in trace if not r.id.endswith("t0"))
    assert hits >= 0.95 * later  # later turns reuse all but their new tokens
    assert off["prefix_cache"]["hit_tokens"] == 0
    assert on["ttft_s"]["all"]["p90"] < off["ttft_s"]["all"]["p90"]
    with pytest.raises(OptionError, match="--slack"):
        RunSpec(slack="fast").build()


def test_cli_sessions_then_run_with_either_slack(tmp_path) -> None:
    from medha_sched.sim.cli import main

    trace = tmp_path / "chat.jsonl"
    args = ["sessions", "--sessions", "2", "--turns", "2", "--qps", "1", "--doc-tokens", "3000"]
    assert main([*args, "--output-tokens", "4", "--out", str(trace)]) == 0
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 4 and all(x["prefix_tokens"] == x["prompt_tokens"] for x in lines)
    cost = "affine:base=1e-3,per_token=1e-5,per_attn=1e-9"
    for slack, caching in (("length", "--enable-prefix-caching"), ("cache-aware", None)):
        out = tmp_path / slack
        run = ["run", "--trace", str(trace), "--out", str(out), "--quiet", "--cost-model", cost]
        assert main([*run, "--slack", slack, *([caching] if caching else [])]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["run"]["slack"] == slack and summary["prefix_cache"]["hit_tokens"] > 0
    off = tmp_path / "off"
    run = ["run", "--trace", str(trace), "--out", str(off), "--quiet", "--cost-model", cost]
    assert main([*run, "--no-enable-prefix-caching"]) == 0
    assert json.loads((off / "summary.json").read_text())["prefix_cache"]["hit_tokens"] == 0
