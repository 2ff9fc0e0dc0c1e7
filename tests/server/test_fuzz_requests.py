"""Generated request bodies against one real ``tiny`` server (hypothesis).

The documented fields of ``/v1/completions``, ``/v1/chat/completions``,
``/tokenize`` and ``/detokenize`` (all but ``bad_words`` and ``cache_salt``, tested
elsewhere) are drawn with valid values and with values of
the wrong type or range (huge and negative ints, NaN and infinity as Python's
JSON writes them, empty and odd strings, lone surrogates, nested junk, wrong
message shapes), fields Medha refuses are drawn with values other than their
"off" value, and random unknown fields are added. Each draw knows whether it
is valid (``OK``), invalid (``BAD``) or either (``MAYBE``, e.g. ``"1"`` for
an int, which pydantic coerces), and every answer must:

- be 200 or a 4xx, never a 5xx, within :data:`BOUND_S` seconds;
- be a 4xx when any field is invalid, naming one of the invalid (or unsure)
  fields in its message or ``param``; a 200 when every field is valid;
- as a 4xx, be an OpenAI error body whose message is a non-empty string and
  holds no traceback;
- as a 200 stream, be well-formed server-sent events that end with
  ``data: [DONE]`` (an error after the 200 comes as an error event).

After the examples the server is still healthy, answers a normal request, and
its log holds no traceback. Examples are derandomized, so CI draws the same.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_runtime.server import protocol
from tests.server.conftest import API_KEY, Server, start_server, stop_server

#: seconds any one request may take (tiny answers in well under one)
BOUND_S = 30.0
#: the ``tiny`` model's vocabulary: ids 0..VOCAB-1 (256 bytes and its specials)
VOCAB = 259
#: a fixed cost model: no start-up calibration
COST = ("--cost-model", "affine:base=0.01,per_token=0.0001,per_attn=0")

OK, MAYBE, BAD = "ok", "maybe", "bad"
#: a lone surrogate: JSON can write it (``"\\ud800"``), UTF-8 cannot
SURROGATE = "\ud800"


@dataclass(frozen=True)
class Field:
    """How to draw one field: ``ok`` gives valid values, ``other`` invalid or unsure
    ones, each as ``(value, verdict)``."""

    ok: st.SearchStrategy[tuple[Any, str]]
    other: st.SearchStrategy[tuple[Any, str]]

    def __or__(self, more: Field) -> Field:
        return Field(self.ok | more.ok, self.other | more.other)


@dataclass
class Case:
    """A request body and what its fields say about the answer.

    ``mess``: ``clean`` draws only valid values, ``one`` makes (about) one field
    invalid or unsure, ``chaos`` lets any field be anything."""

    mess: str
    body: dict[str, Any] = field(default_factory=dict)
    bad: set[str] = field(default_factory=set)
    maybe: set[str] = field(default_factory=set)

    def put(self, name: str, drawn: tuple[Any, str]) -> None:
        value, verdict = drawn
        self.body[name] = value
        if verdict == BAD:
            self.bad.add(name)
        elif verdict == MAYBE:
            self.maybe.add(name)

    def spoil(self, draw: st.DrawFn) -> bool:
        """Whether the next field may be other than valid."""
        if self.mess == "one":
            if self.bad or self.maybe:
                return False
            return draw(st.integers(0, 3)) == 0
        return self.mess == "chaos"

    def pick(self, draw: st.DrawFn, name: str, f: Field) -> None:
        if self.spoil(draw):
            self.put(name, draw(f.other if self.mess == "one" else f.ok | f.other))
        else:
            self.put(name, draw(f.ok))


MESS = st.sampled_from(["clean", "one", "one", "one", "chaos"])


# ------------------------------------------------------------------ values
def tag(strategy: st.SearchStrategy[Any], verdict: str) -> Field:
    drawn = strategy.map(lambda v: (v, verdict))
    return Field(drawn, st.nothing()) if verdict == OK else Field(st.nothing(), drawn)


def any_of(*fields: Field) -> Field:
    return Field(st.one_of(*(f.ok for f in fields)), st.one_of(*(f.other for f in fields)))


#: text that no lax pydantic coercion reads as a number or a bool
WORDS = st.text(alphabet="abcdeklmnopqrsuvwxz", min_size=1, max_size=6).map(lambda s: "zz" + s)
#: short printable text (no surrogates: hypothesis leaves them out)
TEXT = st.text(min_size=1, max_size=10).filter(lambda s: s.strip() != "")
ODD_TEXT = st.sampled_from(
    ["\x00", "\u202e", "\ufeff", "e\u0301", "\U0001f600", "\n\n", "\\", '"', "<|user|>", "\t"]
)
BAD_TEXT = st.sampled_from([SURROGATE, "a" + SURROGATE + "b", "\udfff", "x\udc80"])
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
CONTAINERS = st.lists(JUNK, max_size=3) | st.dictionaries(st.text(max_size=4), JUNK, max_size=3)
HUGE = st.sampled_from([2**31, 2**63, 2**64 + 1, 10**30, -(2**63) - 1])


def an_int(ok: Any, bad: tuple[Any, ...] = (), huge: Any = BAD) -> Any:
    """An int field: ``ok`` draws valid values, ``bad`` lists invalid ones, ``huge``
    says (a verdict, or a function of the value) what a very large or small int is."""
    judge = huge if callable(huge) else lambda _: huge
    return any_of(
        tag(ok, OK),
        tag(st.sampled_from(bad or (None,)), BAD if bad else MAYBE),
        Field(st.nothing(), HUGE.map(lambda v: (v, judge(v)))),
        tag(st.floats(0.1, 5.0).filter(lambda v: v != int(v)), BAD),
        tag(st.sampled_from([math.nan, math.inf]), BAD),
        tag(st.sampled_from([True, "2", 2.0]), MAYBE),
        tag(WORDS | CONTAINERS, BAD),
    )


def a_float(ok: Any, bad: tuple[float, ...]) -> Any:
    """A float field: ``ok`` draws valid values, ``bad`` lists invalid ones."""
    return any_of(
        tag(ok, OK),
        tag(st.sampled_from(bad), BAD),
        tag(st.sampled_from(["0.5", True]), MAYBE),
        tag(WORDS | CONTAINERS, BAD),
    )


def int64(v: int) -> str:
    return OK if -(2**63) <= v < 2**63 else BAD


def a_bool() -> Any:
    return any_of(
        tag(st.booleans(), OK),
        tag(st.sampled_from([0, 1, "true", "no", None]), MAYBE),
        tag(st.sampled_from([2, -1, 0.5]) | WORDS | CONTAINERS, BAD),
    )


def a_string(*, empty: str = OK) -> Any:
    return any_of(
        tag(TEXT | ODD_TEXT, OK),
        tag(st.just(""), empty),
        tag(BAD_TEXT, BAD),
        tag(st.integers() | st.floats() | CONTAINERS, BAD),
    )


def ids(*, min_size: int = 0) -> Any:
    """A list of token ids: in the vocabulary (OK) or not (BAD)."""
    good = st.lists(st.integers(0, VOCAB - 1), min_size=max(1, min_size), max_size=6)
    return any_of(
        tag(good, OK),
        tag(st.lists(st.sampled_from([-1, VOCAB, 2**63, 10**30]), min_size=1, max_size=3), BAD),
        tag(st.lists(WORDS, min_size=1, max_size=2) | st.just([[1]]), BAD),
        tag(WORDS | st.integers(), BAD),
    )


def stop() -> Any:
    return any_of(
        tag(TEXT | st.lists(TEXT, max_size=3), OK),
        tag(st.just("") | st.just([""]) | st.lists(st.integers(), min_size=1, max_size=2), BAD),
        tag(BAD_TEXT | st.lists(BAD_TEXT, min_size=1, max_size=2), BAD),
        tag(st.integers() | st.dictionaries(TEXT, TEXT, min_size=1, max_size=2), BAD),
    )


OUT_OF_RANGE = st.sampled_from([150.0, -101.0, math.nan, math.inf])
NOT_IDS = st.sampled_from(["-1", "x", "1.5", str(VOCAB), "\u00b2", ""])


def logit_bias() -> Any:
    key = st.integers(0, VOCAB - 1).map(str)
    return any_of(
        tag(st.dictionaries(key, st.floats(-100, 100), max_size=3), OK),
        tag(st.dictionaries(key, OUT_OF_RANGE, min_size=1, max_size=2), BAD),
        tag(st.dictionaries(NOT_IDS, st.just(1.0), min_size=1, max_size=2), BAD),
        tag(st.lists(st.integers(), min_size=1, max_size=2) | WORDS, BAD),
    )  # fmt: skip


def model() -> Any:
    return any_of(
        tag(st.just("tiny"), OK),
        tag(st.just(None), OK),
        tag(WORDS | BAD_TEXT | st.just(""), BAD),
        tag(st.integers() | CONTAINERS, BAD),
    )


# ------------------------------------------------------------------ bodies
#: the fields both kinds of request take, and how to draw them
#: valid values at fp32's edges (1e-300 is 0 in fp32, 1e300 inf): the sampler must cope
EDGE = (1e-300, 1e-40, 1e300, 3e38)
COMMON: dict[str, Any] = {
    "temperature": a_float(
        st.floats(0, 2) | st.sampled_from(EDGE), (-1.0, -1e308, math.nan, math.inf, -math.inf)
    ),
    "top_p": a_float(st.floats(0, 1, exclude_min=True), (0.0, -1.0, 1.5, math.nan, math.inf)),
    "top_k": an_int(st.integers(-1, 40), (-2, -1000), huge=MAYBE),
    "min_p": a_float(st.floats(0, 1), (-0.5, 1.5, math.nan, math.inf)),
    "presence_penalty": a_float(st.floats(-2, 2), (-3.0, 3.0, math.nan, -math.inf)),
    "frequency_penalty": a_float(st.floats(-2, 2), (-3.0, 3.0, math.nan, math.inf)),
    "repetition_penalty": a_float(
        st.floats(0, 2, exclude_min=True) | st.sampled_from(EDGE), (0.0, -1.0, math.nan, math.inf)
    ),
    "seed": an_int(st.integers(-(2**63), 2**63 - 1), huge=int64),
    "n": an_int(st.integers(1, 2), (0, -1, 129)),
    "stop": stop(),
    "user": a_string(),
    "logit_bias": logit_bias(),
    "min_tokens": an_int(st.integers(0, 1), (-1, -1000)),
    "ignore_eos": a_bool(),
    "stop_token_ids": ids(),
    "skip_special_tokens": a_bool(),
    "include_stop_str_in_output": a_bool(),
    "prompt_logprobs": an_int(st.integers(0, 3), (-1, 21)),
    "return_tokens_as_token_ids": a_bool(),
    "truncate_prompt_tokens": an_int(st.sampled_from([-1, 1, 2, 8]), (0, -2, -1000, 256)),
    "allowed_token_ids": ids(min_size=1),
    "ttft_slo_ms": (
        a_float(st.floats(1e6, 1e9), (0.0, -1.0, math.nan, math.inf))
        | tag(st.floats(1e-3, 10.0), MAYBE)  # may be a 429: too short to meet
    ),
    "tpot_slo_ms": a_float(st.floats(1e-3, 1e9), (0.0, -1.0, math.nan, math.inf)),
    "priority": an_int(st.integers(-(2**63), 2**63 - 1), huge=MAYBE),
    "cache_salt": a_string(empty=BAD),
    "model": model(),
}  # fmt: skip

#: fields Medha refuses, each with a value other than its "off" one
REFUSED: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "suffix": "x",
    "use_beam_search": True,
    "length_penalty": 2.0,
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"json": {}},
    "response_format": {"type": "json_object"},
    "best_of": 3,
    "logits_processors": ["x"],
    "chat_template": "{{ messages }}",
    "documents": [{"text": "d"}],
    "audio": {"voice": "x"},
    "modalities": ["audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "store": True,
    "kv_transfer_params": {"a": 1},
    "spaces_between_special_tokens": False,
}
#: the same fields at their "off" value (accepted)
OFF: dict[str, Any] = {
    "tools": [],
    "tool_choice": "none",
    "suffix": "",
    "use_beam_search": False,
    "response_format": {"type": "text"},
    "store": False,
    "parallel_tool_calls": True,
    "spaces_between_special_tokens": True,
}

KNOWN = (
    set(protocol.CompletionRequest.model_fields)
    | set(protocol.ChatCompletionRequest.model_fields)
    | set(protocol.TokenizeRequest.model_fields)
    | set(protocol._NOT_IMPLEMENTED)
    | protocol._KNOWN
    | set(REFUSED)
    | {"bad_words", "tokens", "prompt", "messages"}
)
UNKNOWN = st.dictionaries(
    st.text(min_size=1, max_size=10).filter(lambda s: s not in KNOWN), JUNK, max_size=2
)


def maybe_put(draw: st.DrawFn, case: Case, fields: dict[str, Field], one_in: int = 4) -> None:
    """Each of ``fields``, one time in ``one_in``."""
    for name, f in fields.items():
        if draw(st.integers(1, one_in)) == 1:
            case.pick(draw, name, f)


def unknown_fields(draw: st.DrawFn, case: Case) -> None:
    """Fields nobody defines: they pass (and are logged once), so they change nothing."""
    case.body.update(draw(UNKNOWN))


@st.composite
def common_fields(draw: st.DrawFn, case: Case, *, chat: bool) -> None:
    """Some of COMMON's fields, ``max_tokens``, stream and its options, maybe a field
    Medha refuses or one at its "off" value, and some unknown ones."""
    names = draw(st.lists(st.sampled_from(sorted(COMMON)), max_size=5, unique=True))
    for name in names:
        case.pick(draw, name, COMMON[name])
    key = "max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"
    case.pick(draw, key, an_int(st.integers(1, 3), (0, -1, 256)))
    maybe_put(draw, case, {"stream": a_bool()}, 2)
    if draw(st.integers(0, 3)) == 0:
        keys = {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        opts = draw(st.fixed_dictionaries({}, optional=keys))
        stream = case.body.get("stream")
        verdict = OK if stream is True else MAYBE if "stream" in case.maybe else BAD
        if verdict == OK or case.spoil(draw):
            case.put("stream_options", (opts, verdict))
    if draw(st.integers(0, 2)) == 0 and case.spoil(draw):
        name = draw(st.sampled_from(sorted(REFUSED)))
        case.put(name, (REFUSED[name], BAD))
    elif draw(st.integers(0, 4)) == 0:
        name = draw(st.sampled_from(sorted(OFF)))
        case.put(name, (OFF[name], OK))
    unknown_fields(draw, case)
    if {"allowed_token_ids", "min_tokens"} <= set(case.body) and not case.bad:
        case.maybe.add("allowed_token_ids")  # all of them stop tokens: refused with min_tokens


TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)
PROMPT = any_of(
    tag(st.text(min_size=1, max_size=30) | ODD_TEXT, OK),
    tag(st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2), OK),
    tag(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), OK),
    tag(st.lists(TOKEN_IDS, min_size=1, max_size=2), OK),
    tag(st.sampled_from(["", [], [""], [[]], [-1], [VOCAB], [2**64], [[1], [10**20]]]), BAD),
    tag(BAD_TEXT | st.lists(BAD_TEXT, min_size=1, max_size=2), BAD),
    tag(st.sampled_from([[1, "a"], ["a", [1]], 5, None, {"a": 1}, [1.5]]), BAD),
)  # fmt: skip


@st.composite
def completion_cases(draw: st.DrawFn) -> Case:
    case = Case(draw(MESS))
    case.pick(draw, "prompt", PROMPT)
    draw(common_fields(case, chat=False))
    logprobs = an_int(st.integers(0, 3), (-1, 21))
    maybe_put(draw, case, {"logprobs": logprobs, "echo": a_bool(), "add_special_tokens": a_bool()})
    if case.body.get("echo") is True and case.body.get("max_tokens") == 0:
        case.bad.discard("max_tokens")  # scores the prompt (OpenAI's and vLLM's meaning)
        min_tokens = case.body.get("min_tokens")
        if type(min_tokens) is int and min_tokens > 0:
            case.bad.add("min_tokens")  # more than the 0 it may generate
    return case


ROLE = st.sampled_from(protocol.ROLES)
CONTENT = st.text(max_size=8) | ODD_TEXT
PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": CONTENT}), max_size=2)
BAD_CONTENT = st.sampled_from(
    [None, 5, [{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text"}],
     [{"type": "text", "text": 5}], ["text"]]
) | BAD_TEXT  # fmt: skip


def message() -> Field:
    def msg(**kw: Any) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries(kw)

    return any_of(
        tag(msg(role=ROLE, content=CONTENT | PARTS), OK),
        tag(msg(role=ROLE, content=CONTENT, name=TEXT), MAYBE),
        tag(msg(role=WORDS | st.sampled_from(["tool", "", "User"]), content=CONTENT), BAD),
        tag(msg(role=ROLE) | msg(content=CONTENT), BAD),
        tag(msg(role=ROLE, content=BAD_CONTENT), BAD),
        tag(msg(role=ROLE, content=CONTENT, name=BAD_TEXT | st.integers()), BAD),
        tag(msg(role=ROLE, content=CONTENT, tool_calls=st.just([{"id": "1"}])), BAD),
        tag(JUNK.filter(lambda v: not isinstance(v, dict)), BAD),
    )


@st.composite
def conversation(draw: st.DrawFn, spoil: bool, empty: str = BAD) -> tuple[Any, str]:
    """A list of messages and its verdict: a template may refuse an order of roles, so
    only one plain user message is certainly fine. ``empty``: the verdict on ``[]``."""
    m = message()
    if spoil and draw(st.integers(0, 3)) == 0:
        if draw(st.booleans()):
            return [], empty
        return draw(tag(st.sampled_from(["hi", {"role": "user", "content": "hi"}]), BAD).other)
    if not spoil and draw(st.booleans()):
        return [{"role": "user", "content": draw(CONTENT | PARTS)}], OK
    drawn = draw(st.lists(m.ok | m.other if spoil else m.ok, min_size=1, max_size=3))
    verdicts = {v for _, v in drawn}
    one_user = len(drawn) == 1 and drawn[0][1] == OK and drawn[0][0]["role"] == "user"
    verdict = BAD if BAD in verdicts else OK if one_user else MAYBE
    return [value for value, _ in drawn], verdict


#: the chat's own fields (besides messages and logprobs)
CHAT: dict[str, Field] = {
    "add_generation_prompt": a_bool(),
    "continue_final_message": tag(st.just(True), MAYBE) | a_bool(),
    "chat_template_kwargs": any_of(
        tag(st.just({}), OK),
        tag(st.dictionaries(WORDS, JUNK, max_size=2), MAYBE),
        tag(st.integers() | WORDS | st.lists(JUNK, min_size=1), BAD),
    ),
    "echo": tag(st.just(True), BAD) | tag(st.just(False), OK),
    "add_special_tokens": tag(st.just(True), BAD) | tag(st.just(False), OK),
}


@st.composite
def chat_cases(draw: st.DrawFn) -> Case:
    case = Case(draw(MESS))
    case.put("messages", draw(conversation(case.spoil(draw))))
    draw(common_fields(case, chat=True))
    maybe_put(draw, case, {"logprobs": a_bool()}, 2)
    if draw(st.booleans()):
        case.pick(draw, "top_logprobs", an_int(st.integers(0, 3), (-1, 21)))
        top = case.body["top_logprobs"]
        if top in (1, 2, 3) and case.body.get("logprobs") is not True:
            if "logprobs" in case.maybe:
                case.maybe.add("top_logprobs")
            elif case.spoil(draw):
                case.bad.add("top_logprobs")  # it needs logprobs=true
            else:
                case.put("logprobs", (True, OK))
    maybe_put(draw, case, CHAT, 5)
    if case.body.get("continue_final_message") is True:
        case.maybe.add("continue_final_message")
    return case


@st.composite
def tokenize_cases(draw: st.DrawFn) -> Case:
    case = Case(draw(MESS))
    which = "prompt"
    if case.spoil(draw):
        which = draw(st.sampled_from(["both", "neither"]))
        case.bad.add("prompt")  # give exactly one of prompt and messages
    elif draw(st.booleans()):
        which = "messages"
    if which in ("prompt", "both"):
        case.pick(draw, "prompt", a_string())
    if which in ("messages", "both"):
        # /tokenize renders an empty conversation (the template's preamble), as vLLM's does
        case.put("messages", draw(conversation(case.spoil(draw), empty=MAYBE)))
    bools = ("add_special_tokens", "add_generation_prompt", "return_token_strs")
    maybe_put(draw, case, {name: a_bool() for name in bools} | {"model": model()})
    unknown_fields(draw, case)
    return case


@st.composite
def detokenize_cases(draw: st.DrawFn) -> Case:
    case = Case(draw(MESS))
    case.pick(draw, "tokens", tag(st.just([]), OK) | ids())
    maybe_put(draw, case, {"model": model()})
    unknown_fields(draw, case)
    return case


# ------------------------------------------------------------------ checks
def send(server: Server, path: str, case: Case) -> None:
    """Post ``case.body`` and check the answer against what its fields say."""
    raw = json.dumps(case.body, allow_nan=True).encode()  # "\\ud800" stays an escape
    headers = {**server.headers, "Content-Type": "application/json"}
    start = time.monotonic()
    with (
        httpx.Client(timeout=BOUND_S) as client,
        client.stream("POST", server.url + path, content=raw, headers=headers) as r,
    ):
        text = r.read().decode("utf-8")
    took = time.monotonic() - start
    where = f"{path} {raw[:400]!r} -> {r.status_code} {text[:400]!r}"
    assert took < BOUND_S, where
    assert r.status_code == 200 or 400 <= r.status_code < 500, where
    assert "Traceback" not in text, where
    if r.status_code != 200:
        check_error(json.loads(text), case, where)
        return
    assert not case.bad, f"an invalid field was accepted ({sorted(case.bad)}): {where}"
    if r.headers["content-type"].startswith("text/event-stream"):
        check_stream(text, where)
    else:
        assert isinstance(json.loads(text), dict), where


def check_error(body: Any, case: Case, where: str) -> None:
    assert set(body) == {"error"}, where
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"].strip(), where
    assert isinstance(err.get("type"), str) and err["type"], where
    assert case.bad or case.maybe, f"a valid request was refused: {where}"
    named = f"{err['message']} {err.get('param')}"
    assert any(name in named for name in case.bad | case.maybe), (
        f"the error names none of {sorted(case.bad | case.maybe)}: {where}"
    )


def check_stream(text: str, where: str) -> None:
    events = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {where}"
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            assert isinstance(chunk["error"]["message"], str) and chunk["error"]["message"], where
        else:
            assert "choices" in chunk, where


def check_healthy(server: Server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers=server.headers,
        timeout=BOUND_S,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "server.log"


@pytest.fixture(scope="module")
def server(log_path: Path) -> Iterator[Server]:
    with open(log_path, "w") as log:
        s = start_server(*COST, api_key=API_KEY, stderr=log)
        try:
            yield s
        finally:
            stop_server(s)


def fuzz(examples: int) -> Any:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None)


def test_fuzz_completions(server: Server) -> None:
    @fuzz(250)
    @given(completion_cases())
    def run(case: Case) -> None:
        send(server, "/v1/completions", case)

    run()
    check_healthy(server)


def test_fuzz_chat_completions(server: Server) -> None:
    @fuzz(250)
    @given(chat_cases())
    def run(case: Case) -> None:
        send(server, "/v1/chat/completions", case)

    run()
    check_healthy(server)


def tokenize(case: Case) -> tuple[str, Case]:
    return "/tokenize", case


def detokenize(case: Case) -> tuple[str, Case]:
    return "/detokenize", case


def test_fuzz_tokenize_and_detokenize(server: Server) -> None:
    @fuzz(150)
    @given(tokenize_cases().map(tokenize) | detokenize_cases().map(detokenize))
    def run(drawn: tuple[str, Case]) -> None:
        send(server, *drawn)

    run()
    check_healthy(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_refused_field_is_a_400_naming_it(server: Server, path: str) -> None:
    """Each field Medha does not implement, alone at a value other than its "off" one, is
    refused, never silently ignored; at its "off" value it passes."""
    base: dict[str, Any] = {"max_tokens": 1}
    if path.endswith("chat/completions"):
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    for name, value in REFUSED.items():
        r = post(server, path, {**base, name: value})
        assert r.status_code == 400, (name, r.text)
        assert name in r.json()["error"]["message"], (name, r.text)
    for name, value in OFF.items():
        r = post(server, path, {**base, name: value})
        assert r.status_code == 200, (name, r.text)


# ------------------------------------------------------ what the examples found
def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    raw = json.dumps(body, allow_nan=True).encode()
    headers = {**server.headers, "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=BOUND_S)


def assert_400_naming(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, r.text
    assert param in err["message"], r.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "a" + SURROGATE]}, "prompt[1]"),
        ("/v1/completions", {"prompt": "hi", "model": SURROGATE}, "model"),
        ("/v1/completions", {"prompt": "hi", "user": SURROGATE}, "user"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x", SURROGATE]}, "stop[1]"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {SURROGATE: 1},
            },
            "chat_template_kwargs.\\ud800",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" + SURROGATE}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "name": SURROGATE}]},
            "messages[0].name",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
            "messages[0].content[0].text",
        ),
        ("/tokenize", {"prompt": SURROGATE}, "prompt"),
        ("/detokenize", {"tokens": [1], "model": SURROGATE}, "model"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(
    server: Server, path: str, body: dict[str, Any], param: str
) -> None:
    """JSON can escape a lone surrogate, UTF-8 cannot hold it: it was a 500 (the tokenizer
    failed, or the answer echoing it could not be encoded), or passed unnoticed."""
    if path.startswith("/v1/"):
        body = {"max_tokens": 1, **body}
    assert_400_naming(post(server, path, body), param)


def test_out_of_vocab_detokenize_names_tokens(server: Server) -> None:
    assert_400_naming(post(server, "/detokenize", {"tokens": [1, VOCAB]}), "tokens")


@pytest.mark.parametrize("ids", [[VOCAB], [1, 10**30]])
def test_an_out_of_vocab_stop_token_id_is_a_400(server: Server, ids: list[int]) -> None:
    """The model never draws it: it was accepted and the stop silently never happened."""
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": ids})
    assert_400_naming(r, "stop_token_ids")


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64 + 1])
def test_a_seed_outside_64_bits_is_a_400(server: Server, seed: int) -> None:
    """vLLM's bound; it was reduced to 64 bits (2**64 + 1 drew as seed 1 does)."""
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": seed})
    assert_400_naming(r, "seed")
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [0, -3])
def test_max_completion_tokens_below_one_is_named(server: Server, value: int) -> None:
    """It was refused as ``max_tokens``, a field the request did not send."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": value}
    assert_400_naming(post(server, "/v1/chat/completions", body), "max_completion_tokens")


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 1e-40},
        {"temperature": 1e300, "min_tokens": 2},
        {"temperature": 1e300, "allowed_token_ids": [104, 105]},
        {"temperature": 1e300, "repetition_penalty": 1e300},
    ],
)
def test_extreme_sampling_values_answer_and_keep_the_engine(
    server: Server, fields: dict[str, Any]
) -> None:
    """One such request stopped the engine ("probability tensor contains either inf, nan
    or element < 0"), and the server with it: every later request got a 503."""
    for stream in (False, True):
        body = {"prompt": "hello hello", "max_tokens": 3, "stream": stream, **fields}
        body["ignore_eos"] = True  # a uniform draw ended on EOS after one token in 0.4%
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        if stream:
            check_stream(r.text, r.text)
        else:
            assert r.json()["usage"]["completion_tokens"] >= 2
    check_healthy(server)


def test_the_log_holds_no_traceback(server: Server, log_path: Path) -> None:
    """The module's last test: nothing above left a traceback in the server's log."""
    check_healthy(server)
    assert "Traceback" not in log_path.read_text(errors="replace")
