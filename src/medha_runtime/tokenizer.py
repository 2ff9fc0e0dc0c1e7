"""Tokenization, chat templates, stop tokens and streaming detokenization.

A model directory supplies:

- ``tokenizer.json``, read by the ``tokenizers`` library (its post-processor
  adds BOS when ``add_special_tokens`` is true);
- the chat template: ``chat_template.jinja`` if present, else
  ``tokenizer_config.json["chat_template"]`` (a string, or a list of
  ``{"name", "template"}`` where ``"default"`` is used); rendered with a
  sandboxed jinja2 environment providing ``raise_exception``, ``strftime_now``,
  ``bos_token``, ``eos_token`` and ``add_generation_prompt``. Rendered chats
  usually start with BOS already: encode them with ``add_special_tokens=False``
  (``apply_chat_template(..., tokenize=True)`` does);
- stop tokens: ``generation_config.json["eos_token_id"]`` (an int or a list)
  merged with the tokenizer's EOS token.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"

# Tokens of context kept before the new ones when decoding incrementally
# (as vLLM does), so a token's leading space or byte-fallback pieces decode in context.
_CONTEXT_TOKENS = 5
#: single-token texts a :class:`Tokenizer` remembers, per ``skip_special_tokens`` setting
_TOKEN_TEXTS = 1 << 17


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies spell with)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


class ChatTemplateError(ValueError):
    """No chat template, or the template failed (including ``raise_exception``)."""


def read_chat_template(spec: str | os.PathLike[str]) -> str:
    """A chat template given the way vLLM's ``--chat-template`` takes one: the text of
    the file ``spec`` names, else ``spec`` itself where it is Jinja text (holds ``{{``
    or ``{%``). Compiled here, so a broken template fails now rather than at the first
    chat request.

    Raises:
        ChatTemplateError: no such file and no Jinja text, a file that is not UTF-8
            text, or a template that does not compile (each named).
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ChatTemplateError(
            f"chat_template must be a Jinja file's path or Jinja text, got {spec!r}"
        )
    where = ""
    if os.path.isfile(spec):
        where = f"{spec}: "
        try:
            source = Path(spec).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ChatTemplateError(f"chat template {spec}: not UTF-8 text ({exc})") from None
        except OSError as exc:
            raise ChatTemplateError(f"chat template {spec}: cannot be read ({exc})") from None
    elif "{{" in spec or "{%" in spec:
        source = spec
    else:
        raise ChatTemplateError(
            f"chat template {spec!r}: no such file, and not Jinja text (no '{{{{' or '{{%')"
        )
    try:
        _compile(source)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"{where}{exc}") from None  # which file, where one
    return source


def unescape_inline_chat_template(spec: str) -> str:
    """``serve --chat-template``'s value with its backslash escapes (``\\n``, ``\\t``,
    ``\\u00e9``, ``\\\\``) read, as ``vllm serve`` reads them, where it is Jinja text
    rather than a file's path; a path (or anything else) comes back as is. Unlike
    vLLM's ``codecs.decode(..., "unicode_escape")``, non-ASCII characters are kept.

    Raises:
        ChatTemplateError: a malformed escape (such as ``\\x4``), naming the text.
    """
    if os.path.isfile(spec) or ("{{" not in spec and "{%" not in spec):
        return spec
    import codecs
    import warnings

    raw = spec.encode("latin-1", "backslashreplace")  # non-latin-1 text as \\uXXXX
    try:
        with warnings.catch_warnings():  # "invalid escape sequence '\q'": kept as is
            warnings.simplefilter("ignore", DeprecationWarning)
            return codecs.decode(raw, "unicode_escape")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"chat template {spec!r}: {exc.reason}") from None


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def token_ids(value: Any, source: object, key: str = "eos_token_id") -> list[int]:
    """``key`` of a model's JSON file (``source``): a token id, a list of them, or absent
    (null: none); anything else is a ConfigError naming the file and key."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _config_error(
            f"{source}: {key} must be a token id or a list of token ids, got {value!r}"
        )
    return list(ids)


def join_text_parts(parts: Iterable[Mapping[str, Any]]) -> str:
    """A message's OpenAI text content parts (``{"type": "text", "text": str}``, already
    checked) as one string, one part per line, as vLLM joins them."""
    return "\n".join(str(part["text"]) for part in parts)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with its special tokens, chat template and stop ids.

    Args:
        tokenizer: the fast tokenizer.
        bos_token, eos_token: special token strings (None if the model has none).
        chat_template: the Jinja source, or None.
        generation_eos_ids: EOS ids from generation_config.json.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        generation_eos_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        stops = [*generation_eos_ids, *([] if self.eos_token_id is None else [self.eos_token_id])]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        self._template: Any = None
        # decode_token's texts: [skip_special_tokens=False, =True]
        self._token_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, stop_token_ids={list(self.stop_token_ids)})"
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` and, if present, the tokenizer, template and generation configs.

        Raises:
            MissingFileError: no directory or no ``tokenizer.json`` (named).
            ConfigError: a JSON file that does not parse (named).
        """
        directory = Path(path)
        file = directory / TOKENIZER_FILE
        if not file.is_file():
            raise _missing_file_error(f"{file} not found: the tokenizer needs a tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:
            raise _config_error(f"{file}: cannot be read by tokenizers ({exc})") from None
        tcfg = _read_json(directory / TOKENIZER_CONFIG_FILE)
        gcfg = _read_json(directory / GENERATION_CONFIG_FILE)
        template_file = directory / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            try:
                template: str | None = template_file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise _config_error(f"{template_file}: not UTF-8 text ({exc})") from None
        else:
            template = _pick_template(tcfg.get("chat_template"), directory / TOKENIZER_CONFIG_FILE)
        return cls(
            tok,
            bos_token=_token_content(tcfg.get("bos_token")),
            eos_token=_token_content(tcfg.get("eos_token")),
            chat_template=template,
            generation_eos_ids=token_ids(
                gcfg.get("eos_token_id"), directory / GENERATION_CONFIG_FILE
            ),
        )

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with ``chat_template`` (Jinja source) in place of its own."""
        other = copy.copy(self)
        other.chat_template, other._template = chat_template, None
        return other

    @property
    def vocab_size(self) -> int:
        """Including added (special) tokens."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, remembered (a pure function of the id: the
        streaming decoder asks it for every generated token's window)."""
        texts = self._token_texts[bool(skip_special_tokens)]
        text = texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
            if len(texts) < _TOKEN_TEXTS:
                texts[token_id] = text
        return text

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> DetokenizeState:
        """A streaming decoder that continues after ``prompt_ids``."""
        return DetokenizeState(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: end with the assistant turn's header.
            tokenize: return token ids (encoded without adding special tokens,
                since templates emit BOS themselves) instead of text.
            continue_final_message: end the text right after the last message's
                content (no end-of-turn), so the model goes on with that message
                (``transformers``' and vLLM's option); needs
                ``add_generation_prompt=False`` and text content.
            kwargs: extra template variables (``tools``, ``date_string``,
                ``enable_thinking``...; :func:`template_variables` checks a
                caller's mapping of them).

        Raises:
            ChatTemplateError: no template, rendering failed, or the options clash.
        """
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message needs add_generation_prompt=False: the final "
                "message is continued, no new turn is started"
            )
        if self._template is None:
            if not self.chat_template:
                raise ChatTemplateError(
                    "this tokenizer has no chat template (expected chat_template.jinja or "
                    "tokenizer_config.json 'chat_template')"
                )
            self._template = _compile(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(kwargs)
        try:
            text = self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except Exception as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class DetokenizeState:
    """Incremental detokenization for streaming.

    :meth:`add` returns the text the new ids complete. Text is held back while
    it ends in an incomplete UTF-8 sequence (decoded as U+FFFD), so a
    multi-byte character split over tokens is never emitted broken. A window of
    earlier tokens is decoded with the new ones so leading spaces decode as in
    the full text.

    Attributes:
        ids: every id seen (prompt context, then generated).
        text: the text emitted so far (generated part only).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        # the window of the previous add's new text is one token as a rule: remembered
        if len(ids) == 1:
            return self.tokenizer.decode_token(ids[0], self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the newly completed text (maybe ``""``)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever is held back, replacement characters included."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        new = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new


def _config_error(message: str) -> Exception:
    # imported here: medha_runtime.model imports torch, and the HTTP front end uses
    # this module without it
    from medha_runtime.model.errors import ConfigError

    return ConfigError(message)


def _missing_file_error(message: str) -> Exception:
    from medha_runtime.model.errors import MissingFileError

    return MissingFileError(message)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _config_error(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _config_error(f"{file}: expected a JSON object")
    return data


def _pick_template(value: Any, source: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if "default" in named:
            if not isinstance(named["default"], str):
                raise _config_error(
                    f"{source}: chat_template 'default' entry must be a string, "
                    f"got {type(named['default']).__name__}"
                )
            return named["default"]
        raise _config_error(f"{source}: chat_template list has no 'default' entry ({list(named)})")
    raise _config_error(f"{source}: chat_template must be a string or a list, got {type(value)}")


def template_variables(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's extra chat-template variables as keyword arguments of
    :meth:`Tokenizer.apply_chat_template`; ChatTemplateError for a name that is not a
    string or that :meth:`~Tokenizer.apply_chat_template` takes itself."""
    out = dict(kwargs or {})
    own = {"messages", "add_generation_prompt", "tokenize", "continue_final_message"}
    bad = sorted(repr(k) for k in out if not isinstance(k, str) or k in own)
    if bad:
        raise ChatTemplateError(
            f"chat template variable(s) {', '.join(bad)} cannot be set this way: "
            "they are the conversation and the rendering options"
        )
    return out


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` up to the end of the last message's content (its last occurrence; as
    ``transformers`` does, the stripped content where a template trims it)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError(
            "continue_final_message needs a final message with text content to continue"
        )
    for piece in (final, final.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise ChatTemplateError(
        "continue_final_message: the chat template's text does not contain the final "
        "message's content, so it cannot be continued"
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """``source`` compiled (cached: a template is checked at start-up, then used)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
