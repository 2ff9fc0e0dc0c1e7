"""Sampling parameters and the plain data the sampler exchanges (no torch here).

:class:`SamplingParams` is what a user passes per prompt (vLLM's names and
defaults). The engine turns it into a :class:`SampleSpec` for every row it
samples; the sampling rank answers with a :class:`Sampled` per row, and a
:class:`PromptLogprobs` per chunk that asked for prompt logprobs
(:class:`PromptLogprobSpec`). The HTTP front end imports this module, so it
must stay free of torch; the sampler itself is :mod:`medha_runtime.sampling`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

#: temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)
GREEDY_EPS = 1e-5
#: OpenAI's bound on a logit bias (values beyond it are clamped)
MAX_LOGIT_BIAS = 100.0
#: the most top logprobs a request may ask for (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_text(text: str) -> bool:
    """Whether ``text`` is Unicode text: UTF-8 can encode it (no lone surrogate, which
    JSON's ``"\\ud800"`` escape can give and the tokenizer refuses)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stop_tokens(params: SamplingParams, eos_token_ids: Iterable[int]) -> set[int]:
    """The tokens ``min_tokens`` holds back: ``stop_token_ids``, and the model's EOS
    unless ``ignore_eos``."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def check_token_ids(where: str, ids: Iterable[int], vocab: int) -> None:
    """A ValueError naming the first of ``ids`` outside ``0..vocab-1`` (``where`` prefixes
    the message: ``"field: "``, or nothing for a prompt)."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(
            f"{where}token id {bad} is outside the model's vocabulary (0..{vocab - 1})"
        )


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (keys may be digit strings, as JSON sends them) as sorted pairs."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    try:
        for key, bias in items:  # type: ignore[union-attr]
            tok = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not _is_int(tok) or tok < 0 or not is_number(bias):
                raise ValueError
            out[tok] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(bias)))
    except (TypeError, ValueError):
        raise ValueError(
            f"logit_bias must map token ids to finite numbers, got {value!r}"
        ) from None
    return tuple(sorted(out.items()))


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one prompt's completion (vLLM's names and defaults).

    Attributes:
        n: completions per prompt (>= 1). ``LLM.generate`` and ``LLM.chat`` run
            each as an engine request of its own (with ``seed + i`` for the
            ``i``-th where a seed is given, as the server does) and return them
            in one :class:`RequestOutput` (``outputs[i].index == i``);
            ``LLMEngine.add_request`` takes ``n == 1`` only (one completion per
            engine request).
        temperature: 0 (or below 1e-5) is greedy; higher flattens the distribution.
        top_p: keep the smallest set of most likely tokens whose probability
            reaches ``top_p``, in (0, 1]; 1 keeps everything.
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps everything.
        min_p: drop tokens whose probability is below ``min_p`` times the most
            likely token's, in [0, 1]; 0 keeps everything.
        presence_penalty: subtracted from the logit of every token already
            generated, in [-2, 2].
        frequency_penalty: subtracted once per earlier occurrence in the
            output, in [-2, 2].
        repetition_penalty: tokens of the prompt or the output have positive
            logits divided and negative ones multiplied by it; > 0, 1 is off.
        logit_bias: ``{token id: bias}`` added to the logits (clamped to
            [-100, 100]); stored as sorted ``(id, bias)`` pairs.
        seed: seeds this request's own generator (reproducible whatever the
            batch), a 64-bit integer (-2**63 to 2**64 - 1); None draws a seed
            from the engine's seed.
        max_tokens: most tokens to generate (>= 1), or None for as many as the
            context holds (vLLM's). The engine lowers it so prompt plus output fit
            the model's context.
        min_tokens: stop tokens are suppressed and stop strings ignored until
            this many tokens exist (<= max_tokens).
        stop: strings that end generation; the text is cut before the match
            (unless ``include_stop_str_in_output``). A single string is allowed.
        stop_token_ids: token ids that end generation (even with ``ignore_eos``);
            the engine refuses one outside the vocabulary.
        ignore_eos: keep going past the model's EOS tokens (until max_tokens).
        logprobs: None for none; 0 for the chosen tokens' logprobs; ``k`` in
            1..20 adds the ``k`` most likely tokens at each step. They are of the
            model's own distribution (``log_softmax`` of its logits, before
            the bias, penalties, temperature and filters), as vLLM gives them.
        prompt_logprobs: None for none; ``k`` in 0..20: every prompt token after
            the first gets its logprob (and the ``k`` most likely tokens) given
            the tokens before it.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string, or the text
            of the stop token (EOS or one of ``stop_token_ids``), in the text.
        allowed_token_ids: the only tokens that may be drawn (every other one's
            logit is set to -inf before sampling); None allows all. Logprobs stay
            the model's own.
        bad_words: words never generated (vLLM's): each is tokenized as is and,
            where that gives as many tokens but another first one, after a space
            (:func:`bad_words_token_ids`). A one-token word's token is never drawn;
            a longer word's last token is not drawn right after the rest of it
            has been generated (unless it is the only token left to draw).
            Logprobs stay the model's own.
        truncate_prompt_tokens: keep only the prompt's last ``k`` tokens (-1: as
            many as the context holds with one token to generate); None keeps
            all of it (:func:`truncate_prompt`).

    Penalties and bias apply to the raw logits, before the temperature; then
    come the temperature, ``min_p``, ``top_k`` and ``top_p`` (vLLM's order).
    ``stop`` and ``stop_token_ids`` are stored as tuples.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        put = object.__setattr__
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {self.top_k!r}"
            )
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        put(self, "logit_bias", _bias_pairs(self.logit_bias))
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k!r}")
        seed = self.seed
        if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
            raise ValueError(
                f"seed must be None or a 64-bit integer (-2**63 to 2**64 - 1), got {seed!r}"
            )
        mt = self.max_tokens
        if mt is not None and (not _is_int(mt) or mt < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {mt!r}")  # or None
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if mt is not None and self.min_tokens > mt:
            raise ValueError(
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
        put(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
        put(self, "stop_token_ids", tuple(ids))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, (list, tuple))
                or not allowed
                or not all(_is_int(t) and t >= 0 for t in allowed)
            ):
                raise ValueError(
                    "allowed_token_ids must be None or a non-empty list of non-negative "
                    f"integers, got {allowed!r}"
                )
            put(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        words = () if self.bad_words is None else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(
            isinstance(w, str) and w.strip() and is_text(w) for w in words
        ):
            raise ValueError(
                "bad_words must be a list of Unicode strings with a non-space character, "
                f"got {words!r}"
            )
        put(self, "bad_words", tuple(words))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer from 0 to {MAX_LOGPROBS}, got {value!r}"
                )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Whether any penalty needs the request's token history."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)  # type: ignore[arg-type]

    def completion(self, i: int) -> SamplingParams:
        """The params of completion ``i`` of ``n``, one engine request each: ``n`` = 1,
        and, where a seed is given, ``seed + i`` (kept below 2**64; the generator
        takes its low 64 bits anyway)."""
        if i == 0 and self.n == 1:
            return self
        seed = self.seed
        if seed is not None and seed + i >= 2**64:
            seed -= 2**64
        return self.replace(n=1, seed=None if seed is None else seed + i)


class Penalties(NamedTuple):
    """A row's penalties (see :class:`SamplingParams`)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0


class SampleSpec(NamedTuple):
    """How to sample one row: what the sampling worker needs (plain data).

    ``seed`` is always set (the engine derives one for unseeded requests);
    ``suppress`` lists token ids whose logits are set to -inf (stop tokens
    before ``min_tokens``). ``penalties`` (None: none) need the request's
    tokens: the sampler counts the tokens it samples itself, and ``history``
    (the prompt, and any output already made) comes once, with the request's
    first penalized row.
    """

    request_id: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int | None
    suppress: tuple[int, ...] = ()
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    penalties: Penalties | None = None
    history: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    #: the only tokens that may be drawn (empty: all)
    allowed: tuple[int, ...] = ()
    #: token sequences never generated: one token is never drawn; a longer
    #: sequence's last token is not drawn right after the rest of it
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class Sampled(NamedTuple):
    """One sampled token: its id, its logprob (None unless asked) and the top alternatives.

    ``error`` (None: sampled) says why the row could not be sampled (non-finite
    logits, say); ``token_id`` is then 0, a placeholder the engine never outputs
    (it reaches the scheduler as the failed request's last token, and stage 0 as
    the input of a decode of it already issued, whose result is dropped).
    """

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    error: str | None = None


class PromptLogprobSpec(NamedTuple):
    """Prompt logprobs wanted from one chunk.

    ``targets[i]`` is the prompt token at position ``start + i + 1``: its
    logprob given the chunk's row ``i`` is wanted (``len(targets)`` may be
    shorter than the chunk: the prompt's last token predicts no prompt
    token). ``top`` most likely tokens come with each.
    """

    top: int
    targets: tuple[int, ...]


class PromptLogprobs(NamedTuple):
    """The answer to a :class:`PromptLogprobSpec`: per target, ``{token id: logprob}``
    (the target first, then the ``top`` most likely tokens)."""

    request_id: str
    start: int
    entries: tuple[dict[int, float], ...]


def truncate_prompt(
    ids: list[int], keep: int | None, max_model_len: int, max_prompt: int | None = None
) -> list[int]:
    """The prompt's last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``): all of
    them for None; for -1 as many as fit: ``max_model_len - 1`` (room for one output
    token), or ``max_prompt``, the longest prompt the KV memory admits, where less.

    Raises:
        ValueError: ``keep`` below 1 (but -1), or of ``max_model_len`` or more
            (nothing left to generate).
    """
    if keep is None:
        return ids
    if (keep < 1 and keep != -1) or keep >= max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens={keep} must be -1, or from 1 to max_model_len - 1 = "
            f"{max_model_len - 1} (one token to generate)"
        )
    if keep == -1:
        keep = max_model_len - 1 if max_prompt is None else min(max_model_len - 1, max_prompt)
    return ids[-keep:]


def check_allowed_tokens(params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
    """A ValueError where ``min_tokens`` holds back every one of ``allowed_token_ids``
    (each a stop token: one of ``stop_token_ids``, or the model's EOS unless
    ``ignore_eos``): no token could be drawn until ``min_tokens``."""
    allowed = params.allowed_token_ids
    if not allowed or params.min_tokens == 0:
        return
    if set(allowed) <= stop_tokens(params, eos_token_ids):
        raise ValueError(
            f"allowed_token_ids: every allowed token {list(allowed)} is a stop token, which "
            f"min_tokens={params.min_tokens} holds back: no token could be drawn"
        )


def bad_words_token_ids(
    words: Iterable[str], encode: Callable[[str], Sequence[int]]
) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``bad_words`` (vLLM's reading), duplicates dropped.

    ``encode`` tokenizes a text without special tokens. Each word, its leading
    spaces stripped, is taken as encoded, and also after one space where that
    gives as many tokens with another first one (the word inside a sentence).
    """
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            raise ValueError(f"bad_words: {word!r} encodes to no tokens")
        out.setdefault(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            out.setdefault(spaced)
    return tuple(out)


def resolve_bad_words(
    params: SamplingParams,
    encode: Callable[[str], Sequence[int]],
    eos_token_ids: Iterable[int],
    vocab_size: int | None,
) -> tuple[tuple[int, ...], ...]:
    """``params.bad_words`` as token sequences (:func:`bad_words_token_ids`), checked.

    Raises:
        ValueError: (starting ``bad_words:``) a token outside the vocabulary, or
            one-token words that ban every token left to draw (every allowed
            token or the whole vocabulary, less the stop tokens ``min_tokens``
            holds back): no token could be drawn.
    """
    ids = bad_words_token_ids(params.bad_words, encode)
    if vocab_size is not None:
        check_token_ids("bad_words: ", (t for w in ids for t in w), vocab_size)
    banned = {w[0] for w in ids if len(w) == 1}
    if banned:
        _check_drawable(params, banned, eos_token_ids, vocab_size)
    return ids


def _check_drawable(
    params: SamplingParams, banned: set[int], eos_token_ids: Iterable[int], vocab: int | None
) -> None:
    """A ValueError where ``banned`` leaves no token to draw (see :func:`resolve_bad_words`)."""
    held = stop_tokens(params, eos_token_ids) if params.min_tokens else set()
    allowed = params.allowed_token_ids
    if allowed:
        if set(allowed) <= banned:
            raise ValueError(
                f"bad_words: they ban every one of allowed_token_ids {list(allowed)}: "
                "no token could be drawn"
            )
        if set(allowed) <= banned | held:
            raise ValueError(
                f"bad_words: the allowed tokens they leave are stop tokens, which "
                f"min_tokens={params.min_tokens} holds back: no token could be drawn"
            )
        return
    if vocab is None:
        return
    if len(banned) == vocab:  # resolve_bad_words checked that each is below vocab
        raise ValueError(
            "bad_words: they ban every token of the vocabulary: no token could be drawn"
        )
    if len({t for t in banned | held if t < vocab}) == vocab:
        raise ValueError(
            f"bad_words: they ban every token but stop tokens, which min_tokens="
            f"{params.min_tokens} holds back: no token could be drawn"
        )
