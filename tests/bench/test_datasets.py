"""Workloads: the simulator's traces, random lengths, the short/long mix, ShareGPT; prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medha_runtime.bench.datasets import (
    BenchRequest,
    DatasetError,
    compress_length,
    default_long_threshold,
    load_trace,
    mixed_requests,
    random_requests,
)
from medha_runtime.bench.prompts import prepare
from medha_runtime.bench.sharegpt import load_sharegpt
from medha_runtime.bench.tokens import LocalTokens
from medha_runtime.model.tiny import save_tiny
from medha_sched.sim.trace import TraceError
from medha_sched.sim.workload import WorkloadSpec, generate


@pytest.fixture(scope="module")
def tiny_tokens(tmp_path_factory: pytest.TempPathFactory) -> LocalTokens:
    """The tiny model's byte-level tokenizer (BOS added with special tokens)."""
    return LocalTokens(str(save_tiny(tmp_path_factory.mktemp("tiny") / "tiny")))


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- trace
def test_trace_in_arrival_order_with_slos_and_caps(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "t.jsonl",
        '{"id": "b", "arrival_s": 2.0, "prompt_tokens": 500, "output_tokens": 40}',
        '{"id": "a", "arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 3, '
        '"ttft_slo_s": 1.5, "tpot_slo_s": 0.1, "priority": 2}',
    )
    reqs = load_trace(str(path), max_prompt_tokens=100, max_output_tokens=8)
    assert [r.id for r in reqs] == ["a", "b"]
    a, b = reqs
    assert (a.arrival_s, a.prompt_tokens, a.output_tokens) == (0.5, 10, 3)
    assert (a.ttft_slo_s, a.tpot_slo_s, a.priority) == (1.5, 0.1, 2)
    assert (b.prompt_tokens, b.output_tokens) == (100, 8)  # clipped
    assert [r.id for r in load_trace(str(path), num_prompts=1)] == ["a"]


def test_trace_bad_line_names_line_and_field(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "bad.jsonl",
        '{"id": "a", "arrival_s": 0, "prompt_tokens": 4, "output_tokens": 2}',
        '{"id": "b", "arrival_s": 0, "prompt_tokens": 0, "output_tokens": 2}',
    )
    with pytest.raises(TraceError, match=r"bad\.jsonl line 2: prompt_tokens must be an integer"):
        load_trace(str(path))
    empty = write_lines(tmp_path / "empty.jsonl", "")
    with pytest.raises(DatasetError, match="no requests"):
        load_trace(str(empty))


# ---------------------------------------------------------------------------- random
def test_random_lengths_in_range_and_seeded() -> None:
    reqs = random_requests(200, input_len=100, output_len=10, range_ratio=0.5, seed=1)
    prompts = [r.prompt_tokens for r in reqs]
    outputs = [r.output_tokens for r in reqs]
    assert min(prompts) >= 50 and max(prompts) <= 150 and len(set(prompts)) > 20
    assert min(outputs) >= 5 and max(outputs) <= 15
    assert reqs == random_requests(200, input_len=100, output_len=10, range_ratio=0.5, seed=1)
    fixed = random_requests(5, input_len=7, output_len=3, range_ratio=0.0, seed=0)
    assert {(r.prompt_tokens, r.output_tokens) for r in fixed} == {(7, 3)}
    assert len({r.id for r in reqs}) == 200


# ----------------------------------------------------------------------------- mixed
def test_mixed_without_caps_is_the_simulator_workload() -> None:
    reqs = mixed_requests(30, long_fraction=0.2, seed=4)
    spec = WorkloadSpec(qps=1.0, num_requests=30, long_fraction=0.2, seed=4)
    expected = [(r.prompt_tokens, r.output_tokens) for r in generate(spec)]
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == expected


def test_mixed_compressed_to_a_small_model_keeps_short_and_long_apart() -> None:
    reqs = mixed_requests(
        400, long_fraction=0.25, seed=0, max_prompt_tokens=96, max_output_tokens=6
    )
    threshold = default_long_threshold("mixed", 96)
    long = [r for r in reqs if r.prompt_tokens > threshold]
    short = [r for r in reqs if r.prompt_tokens <= threshold]
    assert all(1 <= r.prompt_tokens <= 96 and 1 <= r.output_tokens <= 6 for r in reqs)
    assert 0.15 < len(long) / len(reqs) < 0.35
    assert min(r.prompt_tokens for r in long) >= 2 * max(r.prompt_tokens for r in short)
    everything_long = mixed_requests(20, long_fraction=1.0, seed=0, max_prompt_tokens=96)
    assert all(r.prompt_tokens > threshold for r in everything_long)


def test_compress_length() -> None:
    assert compress_length(1 << 20, 96) == 96
    assert compress_length(12345, None) == 12345
    values = [compress_length(x, 200) for x in (1, 10, 1000, 100_000, 1_000_000)]
    assert values == sorted(values) and values[0] == 1 and values[-1] <= 200
    assert default_long_threshold("trace", None) == 8192


def test_request_lengths_are_validated() -> None:
    with pytest.raises(ValueError, match="output_tokens must be >= 1, got 0"):
        BenchRequest(id="x", prompt_tokens=3, output_tokens=0)


# -------------------------------------------------------------------------- sharegpt
def sharegpt_file(path: Path, entries: object) -> Path:
    path.write_text(json.dumps(entries, indent=1))
    return path


def conv(*turns: tuple[str, str], cid: str = "c") -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_first_human_turn_and_reply_length(tmp_path: Path, tiny_tokens) -> None:
    path = sharegpt_file(
        tmp_path / "sg.json",
        [
            conv(("system", "be brief"), ("human", "hello there"), ("gpt", "hi!"), cid="a"),
            conv(("gpt", "no question"), cid="b"),  # no human turn: skipped
            conv(("human", "x" * 40), ("gpt", "long enough reply"), cid="c"),
        ],
    )
    reqs = load_sharegpt(str(path), num_prompts=10, seed=0, source=tiny_tokens)
    by_text = {r.text: r for r in reqs}
    assert set(by_text) == {"hello there", "x" * 40}
    hello = by_text["hello there"]
    assert hello.prompt_tokens == len("hello there") + 1  # bytes + BOS
    assert hello.output_tokens == len("hi!")
    caps = {"max_prompt_tokens": 20, "max_output_tokens": 2}
    capped = load_sharegpt(str(path), num_prompts=10, seed=0, source=tiny_tokens, **caps)
    assert [(r.text, r.output_tokens) for r in capped] == [("hello there", 2)]
    one = load_sharegpt(str(path), num_prompts=1, seed=0, source=tiny_tokens)
    assert len(one) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"conversations": []}', r"expected a JSON list of conversations, got dict"),
        ('[\n{"conversations": [}\n]', r"sg\.json line 2 column \d+: invalid JSON"),
        ('[{"id": "q", "conversations": "hi"}]', r"entry 0 \(id 'q'\): field 'conversations'"),
        (
            '[{"conversations": []}, {"conversations": [{"from": "human"}]}]',
            r"entry 1: conversations\[0\]\.value must be a string, got nothing",
        ),
        ("[3]", r"entry 0: expected an object, got int"),
        ('[{"conversations": [{"from": "gpt", "value": "a"}]}]', "no usable conversation"),
    ],
)
def test_sharegpt_bad_input_names_the_problem(
    tmp_path: Path, tiny_tokens, content: str, message: str
) -> None:
    path = tmp_path / "sg.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_sharegpt(str(path), num_prompts=5, seed=0, source=tiny_tokens)


def test_sharegpt_needs_a_tokenizer(tmp_path: Path) -> None:
    path = sharegpt_file(tmp_path / "sg.json", [conv(("human", "a"), ("gpt", "b"))])
    with pytest.raises(DatasetError, match="needs a tokenizer"):
        load_sharegpt(str(path), num_prompts=5, seed=0, source=None)


# --------------------------------------------------------------------------- prompts
def test_prompts_have_the_requested_length(tiny_tokens) -> None:
    reqs = [
        BenchRequest(id="s", prompt_tokens=12, output_tokens=3, ttft_slo_s=0.5, priority=1),
        BenchRequest(id="l", prompt_tokens=40, output_tokens=2),
    ]
    kw = {"source": tiny_tokens, "seed": 0, "long_threshold": 20}
    tokens = prepare(reqs, prompt_format="tokens", **kw)
    assert [len(p.prompt) for p in tokens] == [12, 40]
    assert [p.kind for p in tokens] == ["short", "long"]
    assert all(isinstance(t, int) and 0 <= t < 256 for p in tokens for t in p.prompt)
    assert (tokens[0].max_tokens, tokens[0].ttft_slo_s, tokens[0].priority) == (3, 0.5, 1)
    assert tokens[0].prompt != tokens[1].prompt[:12]  # drawn independently
    text = prepare(reqs, prompt_format="text", **kw)
    for p, r in zip(text, reqs, strict=True):
        assert isinstance(p.prompt, str)
        assert len(tiny_tokens.encode(p.prompt, special=True)) == p.prompt_tokens == r.prompt_tokens
    with pytest.raises(RuntimeError, match="needs a tokenizer"):
        prepare(reqs, prompt_format="text", source=None, seed=0, long_threshold=20)
