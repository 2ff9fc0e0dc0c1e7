"""OpenAI response shapes, as pure functions of plain data (no I/O, no engine).

Tokens are shown through a :class:`TokenText`: a token's own string (see
:mod:`medha_runtime.server.tokens`; ``token_id:N`` with
``return_tokens_as_token_ids``) and its real bytes. A logprobs entry is
``{token_id: logprob}`` holding the chosen (or prompt) token and the top-k
alternatives; ``None`` stands for the first prompt token, which has no
logprob. A logprob of ``-inf`` is written as ``-9999.0``, as vLLM writes it:
JSON has no infinity.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Entry = dict[int, float]

#: what a logprob of -inf is written as (vLLM's value; JSON has no infinity)
MIN_LOGPROB = -9999.0


def _lp(value: float | None) -> float | None:
    """A logprob as JSON can carry it (None stays None)."""
    return None if value is None else max(value, MIN_LOGPROB)


@dataclass(frozen=True)
class TokenText:
    """How tokens are written: ``text(id)`` and ``raw(id)`` (bytes)."""

    text: Callable[[int], str]
    raw: Callable[[int], bytes]

    @classmethod
    def as_ids(cls) -> TokenText:
        """``token_id:N`` strings (vLLM's ``return_tokens_as_token_ids``)."""
        return cls(lambda t: f"token_id:{t}", lambda t: f"token_id:{t}".encode())


def _top(entry: Entry, k: int | None = None) -> list[tuple[int, float]]:
    """The entry's tokens, most likely first (``k`` of them if given)."""
    items = sorted(entry.items(), key=lambda kv: -kv[1])
    return items if k is None else items[:k]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Entry | None],
    tokens: TokenText,
    *,
    top: int,
    pieces: Sequence[str],
    text_offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``token_ids`` (one entry each).

    ``pieces``: per token, the text it adds to the returned text (``""`` for a
    token whose character a later token completes, or a special token the text
    leaves out); ``text_offset`` is each token's character offset into the
    returned text (OpenAI's meaning), starting at ``text_offset``.
    """
    strs, lps, tops, offsets = [], [], [], []
    pos = text_offset
    for tok, e, piece in zip(token_ids, entries, pieces, strict=True):
        s = tokens.text(tok)
        strs.append(s)
        offsets.append(pos)
        pos += len(piece)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(_lp(e.get(tok)))
        alts = {tokens.text(t): _lp(lp) for t, lp in _top(e, top)} if top else {}
        alts.setdefault(s, _lp(e.get(tok)))  # the chosen token is always listed (OpenAI's shape)
        tops.append(alts)
    return {"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def fit_pieces(pieces: Sequence[str], text: str) -> list[str]:
    """``pieces`` (per token, its text) cut from ``text`` so that they join to it
    exactly: each piece's end is kept where it falls inside ``text``, the last piece
    takes the rest (a tokenizer whose decoding differs from the text given, say in
    its spaces, still gets offsets that index that text, in order)."""
    out, start, end = [], 0, 0
    for piece in pieces:
        end = min(end + len(piece), len(text))
        out.append(text[start:end])
        start = end
    if out:
        out[-1] += text[start:]
    return out


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry], tokens: TokenText, *, top: int
) -> dict[str, Any]:
    """The chat ``logprobs`` object: per token its string, logprob, bytes and top list."""
    content = []
    for tok, e in zip(token_ids, entries, strict=True):
        content.append(
            {
                "token": tokens.text(tok),
                "logprob": _lp(e.get(tok)),
                "bytes": list(tokens.raw(tok)),
                "top_logprobs": [
                    {"token": tokens.text(t), "logprob": _lp(lp), "bytes": list(tokens.raw(t))}
                    for t, lp in _top(e, top)
                ],
            }
        )
    return {"content": content}


def prompt_logprobs(
    entries: Sequence[Entry | None], tokens: TokenText, *, top: int
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token ``{id: {logprob, rank, decoded_token}}``.

    ``rank`` (1: the most likely) is known for the ``top`` most likely tokens;
    a prompt token outside them has rank None. An entry may hold more
    alternatives than ``top`` (``echo`` with a larger ``logprobs`` asks the
    engine for more): only the ``top`` most likely are written.
    """
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        first = next(iter(e))
        ranks: dict[int, int | None] = {first: None}  # None: not among the top ones
        ranks.update((t, r) for r, (t, _) in enumerate(_top(e, top), start=1))
        out.append(
            {
                str(t): {"logprob": _lp(e[t]), "rank": r, "decoded_token": tokens.text(t)}
                for t, r in ranks.items()
            }
        )
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached`` fills ``prompt_tokens_details.cached_tokens``."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


#: characters that JSON leaves raw but ``str.splitlines`` (httpx's ``aiter_lines``,
#: and so the openai client) takes for line ends: escaped, so an event stays one line
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    """One server-sent event, on one line whatever the text holds."""
    text = json.dumps(obj, ensure_ascii=False)
    if not text.isascii():  # the three line breaks are not ASCII (a token's event mostly is)
        text = text.translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"
