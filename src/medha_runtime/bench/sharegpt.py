"""ShareGPT conversations as benchmark requests.

The file is a JSON list of ``{"id": ..., "conversations": [{"from": "human",
"value": "..."}, {"from": "gpt", "value": "..."}, ...]}``. The first human
(``human``/``user``) turn is the prompt and the turn after it the reply; the
reply's token count is the output length. Conversations without such a pair
are skipped; a structurally bad entry raises :class:`DatasetError` naming the
entry and field. Entries are shuffled with the seed (as vLLM's benchmark
does) and tokenized until ``num_prompts`` are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from medha_runtime.bench.datasets import BenchRequest, DatasetError
from medha_runtime.bench.tokens import TokenSource

HUMAN = ("human", "user")


def load_sharegpt(
    path: str,
    *,
    num_prompts: int,
    seed: int,
    source: TokenSource | None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[BenchRequest]:
    """Up to ``num_prompts`` requests; prompts longer than ``max_prompt_tokens`` are skipped."""
    if source is None:
        raise DatasetError(
            "the sharegpt dataset needs a tokenizer to count tokens: pass --tokenizer DIR, "
            "or use a server that answers POST /tokenize"
        )
    name = Path(path).name
    pairs = [_pair(entry, i, name) for i, entry in enumerate(read_entries(path))]
    out: list[BenchRequest] = []
    for i in np.random.default_rng(seed).permutation(len(pairs)):
        pair = pairs[i]
        if pair is None:
            continue
        prompt_ids = source.encode(pair[0], special=True)
        prompt_len = len(prompt_ids)
        output_len = len(source.encode(pair[1], special=False))
        if output_len < 1 or (max_prompt_tokens is not None and prompt_len > max_prompt_tokens):
            continue
        if max_output_tokens is not None:
            output_len = min(output_len, max_output_tokens)
        out.append(
            BenchRequest(
                id=f"sharegpt-{i}",
                prompt_tokens=prompt_len,
                output_tokens=output_len,
                text=pair[0],
                text_ids=tuple(prompt_ids),
            )
        )
        if len(out) == num_prompts:
            break
    if not out:
        raise DatasetError(f"{name}: no usable conversation (a human turn followed by a reply)")
    return out


def read_entries(path: str) -> list[Any]:
    """The file's top-level JSON list."""
    name = Path(path).name
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"{name} line {exc.lineno} column {exc.colno}: invalid JSON ({exc.msg})"
        ) from None
    if not isinstance(data, list):
        raise DatasetError(f"{name}: expected a JSON list of conversations, got {_kind(data)}")
    return data


def _pair(entry: Any, index: int, name: str) -> tuple[str, str] | None:
    """(prompt, reply) of one entry, ``None`` if it has no human turn with a reply."""
    where = f"{name} entry {index}"
    if not isinstance(entry, dict):
        raise DatasetError(f"{where}: expected an object, got {_kind(entry)}")
    if isinstance(entry.get("id"), str):
        where += f" (id {entry['id']!r})"
    turns = entry.get("conversations")
    if not isinstance(turns, list):
        raise DatasetError(f"{where}: field 'conversations' must be a list, got {_kind(turns)}")
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DatasetError(f"{where}: conversations[{j}] must be an object, got {_kind(turn)}")
        for key in ("from", "value"):
            value = turn.get(key)
            if not isinstance(value, str):
                raise DatasetError(
                    f"{where}: conversations[{j}].{key} must be a string, got {_kind(value)}"
                )
    for j, turn in enumerate(turns[:-1]):
        if turn["from"].lower() in HUMAN and turn["value"].strip():
            return turn["value"], turns[j + 1]["value"]
    return None


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
