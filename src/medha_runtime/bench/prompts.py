"""Turn requests-by-length into prompts: token-id lists, or text of about that many tokens.

``tokens``: ids drawn at random from the pool (:func:`medha_runtime.bench.tokens.token_pool`),
sent as a list of ints to ``/v1/completions`` (the OpenAI API allows it). ``text``:
the same ids decoded, re-encoded and trimmed once, so the text has about the
requested length counted as the server counts it (special tokens included);
the measured length is recorded. ShareGPT prompts keep their own text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from medha_runtime.bench.datasets import BenchRequest
from medha_runtime.bench.tokens import TokenSource, token_pool


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedRequest:
    """A request ready to send.

    Attributes:
        id: request id.
        kind: ``"short"`` or ``"long"`` (by prompt length against the long threshold).
        prompt: token ids or text.
        prompt_tokens: the prompt's length in tokens (as far as known before sending).
        max_tokens: output length asked for.
        ttft_slo_s, tpot_slo_s, priority: from the dataset (sent unless disabled).
    """

    id: str
    kind: str
    prompt: list[int] | str
    prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0


def prepare(
    requests: Sequence[BenchRequest],
    *,
    prompt_format: str,
    source: TokenSource | None,
    seed: int,
    long_threshold: int,
) -> list[PreparedRequest]:
    """Prompts for ``requests`` (deterministic in ``seed`` for a given tokenizer)."""
    if prompt_format == "text" and source is None:
        raise RuntimeError(
            "--prompt-format text needs a tokenizer: pass --tokenizer DIR, or use a server "
            "that answers POST /tokenize"
        )
    rng = np.random.default_rng([seed, 1])
    pool = np.asarray(token_pool(source), dtype=np.int64)
    special = len(source.encode("", special=True)) if prompt_format == "text" else 0
    out = []
    for r in requests:
        prompt, n = _prompt(r, prompt_format, source, rng, pool, special)
        out.append(
            PreparedRequest(
                id=r.id,
                kind="long" if n > long_threshold else "short",
                prompt=prompt,
                prompt_tokens=n,
                max_tokens=r.output_tokens,
                ttft_slo_s=r.ttft_slo_s,
                tpot_slo_s=r.tpot_slo_s,
                priority=r.priority,
            )
        )
    return out


def _prompt(
    r: BenchRequest,
    fmt: str,
    source: TokenSource | None,
    rng: np.random.Generator,
    pool: np.ndarray,
    special: int,
) -> tuple[list[int] | str, int]:
    if r.text is not None:
        if fmt == "text":
            return r.text, r.prompt_tokens
        if r.text_ids is not None:
            return list(r.text_ids), len(r.text_ids)
        assert source is not None  # the ShareGPT loader needs one too
        ids = source.encode(r.text, special=True)
        return ids, len(ids)
    if fmt == "tokens":
        return _draw(rng, pool, r.prompt_tokens), r.prompt_tokens
    assert source is not None
    return text_of_length(source, rng, pool, r.prompt_tokens, special=special)


def text_of_length(
    source: TokenSource,
    rng: np.random.Generator,
    pool: np.ndarray,
    n: int,
    *,
    special: int | None = None,
) -> tuple[str, int]:
    """Text that encodes (special tokens included) to about ``n`` tokens, and its length.

    ``special``: how many tokens ``source`` adds to any text (computed when None).
    """
    if special is None:
        special = len(source.encode("", special=True))
    body = max(1, n - special)
    text = source.decode(_draw(rng, pool, body))
    ids = source.encode(text, special=False)
    if len(ids) != body:  # decoding merged or split tokens: trim or pad once
        ids = ids[:body] + _draw(rng, pool, max(0, body - len(ids)))
        text = source.decode(ids)
    return text, len(source.encode(text, special=True))


def _draw(rng: np.random.Generator, pool: np.ndarray, n: int) -> list[int]:
    return [int(t) for t in rng.choice(pool, size=n)]
