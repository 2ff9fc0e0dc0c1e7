"""Request bodies (OpenAI's fields, vLLM's extensions, Medha's SLO fields) and error bodies.

Every field is honoured or refused. :func:`check_request` refuses (HTTP 400,
naming the field) what Medha does not implement: tools and function calls,
a ``response_format`` other than text, content parts other than text,
``suffix``, ``best_of`` other than ``n``, beam search, guided decoding, and
the like; also unknown message roles and messages without content.
:func:`check_text` refuses a string that is not Unicode text (a lone
surrogate, which JSON can escape and UTF-8 cannot hold). A field
nobody knows passes, as vLLM lets it pass, and is logged at warning level
once per name (:func:`unknown_fields`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from medha_runtime.sampling_params import is_text

TokenIds = list[int]

#: chat roles the templates know
ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """Answered as an OpenAI error body with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.logged = False


class RefusedField(ValueError):
    """A request field Medha does not implement (or a value it cannot honour)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _null_is_default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A field's default where the body gives null (vLLM declares these ``Optional``)."""
    if value is None and info.field_name is not None:
        return cls.model_fields[info.field_name].default
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False

    _nulls = field_validator("include_usage", "continuous_usage_stats", mode="before")(
        classmethod(_null_is_default)
    )


class _Common(BaseModel):
    # unknown fields pass (vLLM lets them pass); check_request refuses known ones we lack
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=128)
    stop: Union[str, list[str], None] = None  # noqa: UP007
    # a 64-bit signed seed, as vLLM bounds it (a larger one was reduced to 64 bits)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's records: nothing to do
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False
    # keep only the prompt's last k tokens (-1: the last max_model_len - 1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Medha: fed to the scheduler (priority: lower runs earlier, vLLM's meaning)
    ttft_slo_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tpot_slo_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    priority: int = 0
    # vLLM: prefix-cache hits only on blocks of requests with the same salt
    cache_salt: str | None = None

    _nulls = field_validator(
        "n",
        "stream",
        "return_tokens_as_token_ids",
        "echo",
        "logprobs",
        mode="before",
        check_fields=False,
    )(classmethod(_null_is_default))  # echo: completions only; logprobs: both


class CompletionRequest(_Common):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]  # noqa: UP007
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None  # noqa: UP007
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ------------------------------------------------------------------ refusals
def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


#: fields OpenAI or vLLM define that Medha does not implement: the value each
#: may take (its "off" value); any other value is refused
_NOT_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_absent, "tool calling is not supported"),
    "tool_choice": (_is("none"), "tool calling is not supported"),
    "parallel_tool_calls": (lambda v: True, ""),
    "functions": (_absent, "function calling is not supported"),
    "function_call": (_is("none"), "function calling is not supported"),
    "suffix": (_is(""), "suffix (insertion) is not supported"),
    "use_beam_search": (_is(False), "beam search is not supported"),
    "length_penalty": (_is(1, 1.0), "length_penalty needs beam search, which is not supported"),
    "guided_json": (_absent, "guided decoding is not supported"),
    "guided_regex": (_absent, "guided decoding is not supported"),
    "guided_choice": (_absent, "guided decoding is not supported"),
    "guided_grammar": (_absent, "guided decoding is not supported"),
    "guided_decoding_backend": (_absent, "guided decoding is not supported"),
    "guided_whitespace_pattern": (_absent, "guided decoding is not supported"),
    "structured_outputs": (_absent, "structured outputs are not supported"),
    "logits_processors": (_absent, "logits_processors is not supported"),
    "spaces_between_special_tokens": (_is(True), "only spaces_between_special_tokens=true"),
    "chat_template": (_absent, "a request's own chat_template is not supported"),
    "documents": (_absent, "documents are not supported"),
    "mm_processor_kwargs": (_absent, "multimodal inputs are not supported"),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or list(v) == ["text"], "only the text modality"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "reasoning_effort": (_absent, "reasoning_effort is not supported"),
    "store": (_is(False), "stored completions are not supported"),
    "logprobs_processors": (_absent, "logprobs_processors is not supported"),
    "kv_transfer_params": (_absent, "KV transfer is not supported"),
}


def check_request(body: _Common, *, chat: bool) -> None:
    """Raise :class:`RefusedField` for a field or value Medha does not implement."""
    extra = body.model_extra or {}
    for name, value in extra.items():
        rule = _NOT_IMPLEMENTED.get(name)
        if rule is not None and not rule[0](value):
            raise RefusedField(name, f"{name}: {rule[1]}")
    fmt = extra.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise RefusedField(
            "response_format",
            f"response_format: only {{'type': 'text'}} is supported, got type {kind!r}",
        )
    best_of = extra.get("best_of")
    if best_of is not None and best_of != body.n:
        raise RefusedField(
            "best_of", f"best_of: only best_of equal to n ({body.n}) is supported, got {best_of!r}"
        )
    if body.cache_salt == "":
        raise RefusedField("cache_salt", "cache_salt: must be a non-empty string if provided")
    if body.stream_options is not None and not body.stream:
        raise RefusedField("stream_options", "stream_options: only allowed when stream is true")
    for key, value in (body.logit_bias or {}).items():
        if not (key.strip().isascii() and key.strip().isdigit()):  # '²' is a digit to isdigit
            raise RefusedField("logit_bias", f"logit_bias: keys must be token ids, got {key!r}")
        if not -100 <= value <= 100:
            raise RefusedField(
                "logit_bias", f"logit_bias: values must be in [-100, 100], got {value!r}"
            )
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise RefusedField("top_logprobs", "top_logprobs: needs logprobs to be true")
        if extra.get("echo"):
            raise RefusedField("echo", "echo: not supported for chat completions")
        if extra.get("add_special_tokens"):
            raise RefusedField(
                "add_special_tokens", "add_special_tokens: the chat template adds them"
            )
        check_messages(body.messages)


def check_messages(messages: list[ChatMessage]) -> None:
    """Raise :class:`RefusedField` for a role, content part or message field we lack."""
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if m.role not in ROLES:
            raise RefusedField(
                f"{at}.role",
                f"{at}.role: unknown role {m.role!r}; known: {', '.join(ROLES)}",
            )
        for name in ("tool_calls", "function_call", "tool_call_id", "audio", "refusal"):
            if not _absent((m.model_extra or {}).get(name)):
                raise RefusedField(f"{at}.{name}", f"{at}.{name}: not supported")
        if m.content is None:
            raise RefusedField(f"{at}.content", f"{at}.content: a message needs content")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                kind = part.get("type")
                if kind != "text":
                    raise RefusedField(
                        f"{at}.content[{j}].type",
                        f"{at}.content[{j}]: only text parts are supported, got type {kind!r}",
                    )
                if not isinstance(part.get("text"), str):
                    raise RefusedField(
                        f"{at}.content[{j}].text",
                        f"{at}.content[{j}].text: a text part needs a string, "
                        f"got {part.get('text')!r}",
                    )


def check_text(body: BaseModel) -> None:
    """Raise :class:`RefusedField` for a string (or a field's name) in the body that is
    not Unicode text: JSON can escape a lone surrogate (``"\\ud800"``), UTF-8 cannot
    hold one, so the tokenizer, the log and the answer would fail on it."""
    at = _surrogate_at(body, "")
    if at is not None:
        param = at.lstrip(".") or "body"
        raise RefusedField(
            param, f"{param}: a string holds a lone surrogate, which is not valid Unicode text"
        )


def _surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string in ``value`` that UTF-8 cannot encode, or None."""
    if isinstance(value, str):
        return None if is_text(value) else path
    if isinstance(value, BaseModel):
        items = [(n, getattr(value, n)) for n in type(value).model_fields]
        items += list((value.model_extra or {}).items())
        value = dict(items)
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if isinstance(key, str) else path
            if isinstance(key, str) and not is_text(key):
                return f"{path}.{_escaped(key)}"
            found = _surrogate_at(item, name)
            if found is not None:
                return found
    elif isinstance(value, list) and value:
        if isinstance(value[0], int) and _INDEX.sub("", path) in _TOKEN_ID_FIELDS:
            return None  # token ids: the field's type made every item an int
        for i, item in enumerate(value):
            if isinstance(item, (str, list, dict, BaseModel)):
                found = _surrogate_at(item, f"{path}[{i}]")
                if found is not None:
                    return found
    return None


#: the body's fields of token ids (``[int]``, or ``[[int]]`` for ``prompt``), whose lists
#: :func:`_surrogate_at` skips unread; any other list is read whole (``[1, "\\ud800"]`` in
#: ``chat_template_kwargs`` reached the tokenizer)
_TOKEN_ID_FIELDS = {".prompt", ".tokens", ".stop_token_ids", ".allowed_token_ids"}
_INDEX = re.compile(r"\[\d+\]")


def _escaped(text: str) -> str:
    """``text`` with what UTF-8 cannot encode as ``\\udXXXX`` escapes (safe to answer)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


#: fields of every kind that are known but need no check (their meaning is
#: honoured elsewhere, or they only matter with a field that is refused)
_KNOWN = {"response_format", "best_of", "echo", "add_special_tokens"}


def unknown_fields(body: BaseModel) -> list[str]:
    """Names in the request (and its stream options) that no rule knows."""
    names = [n for n in (body.model_extra or {}) if n not in _NOT_IMPLEMENTED and n not in _KNOWN]
    opts = getattr(body, "stream_options", None)
    if opts is not None:
        names += [f"stream_options.{n}" for n in (opts.model_extra or {})]
    for m in getattr(body, "messages", None) or ():
        names += [f"messages[].{n}" for n in (m.model_extra or {}) if n not in _MESSAGE_FIELDS]
    return names


_MESSAGE_FIELDS = {"tool_calls", "function_call", "tool_call_id", "audio", "refusal"}
