"""Where the benchmark gets token ids: a local tokenizer, or the server's /tokenize.

Prompts of a given length are made of token ids drawn from a pool: the ids of
:data:`FILLER` under the model's tokenizer, so every id is an ordinary token of
that vocabulary. With neither ``--tokenizer`` nor a server that answers
``POST /tokenize``, the pool is ids 32-126 (printable ASCII in byte-level and
most BPE vocabularies) and the session warns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import httpx

FILLER = (
    "The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing "
    "matches; meanwhile a curious engineer measures latency, throughput and goodput of a "
    "language model server under bursty load, writing numbers, notes and questions in a "
    "small journal: why does the first token take longer when long prompts arrive?"
)
#: the fallback pool when no tokenizer can be reached
ASCII_POOL = tuple(range(32, 127))


class TokenSource(Protocol):
    """Encodes and decodes text as the server's model does."""

    name: str

    def encode(self, text: str, *, special: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class LocalTokens:
    """A Hugging Face tokenizer directory (``tokenizer.json``) read with ``tokenizers``."""

    def __init__(self, path: str) -> None:
        from medha_runtime.tokenizer import Tokenizer

        self._tok = Tokenizer.from_pretrained_dir(path)
        self.name = f"tokenizer {path}"

    def encode(self, text: str, *, special: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=special)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class ServerTokens:
    """The server's ``POST /tokenize`` and ``POST /detokenize`` (vLLM's and Medha's API)."""

    def __init__(self, client: httpx.Client, root: str, model: str) -> None:
        self._client, self._root, self._model = client, root, model
        self.name = f"{root}/tokenize"

    def encode(self, text: str, *, special: bool) -> list[int]:
        body = {"model": self._model, "prompt": text, "add_special_tokens": special}
        return [int(t) for t in self._post("/tokenize", body)["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        body = {"model": self._model, "tokens": [int(t) for t in ids]}
        return str(self._post("/detokenize", body)["prompt"])

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        r = self._client.post(f"{self._root}{path}", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"POST {path} failed: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()


def open_token_source(
    client: httpx.Client, root: str, model: str, tokenizer: str | None
) -> TokenSource | None:
    """``--tokenizer`` if given, else the server's /tokenize if it answers, else ``None``."""
    if tokenizer:
        return LocalTokens(tokenizer)
    source = ServerTokens(client, root, model)
    try:
        source.encode("hello", special=False)
    except (RuntimeError, httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return source


def token_pool(source: TokenSource | None) -> list[int]:
    """Distinct ids of :data:`FILLER` (or :data:`ASCII_POOL` without a tokenizer)."""
    if source is None:
        return list(ASCII_POOL)
    pool = sorted(set(source.encode(FILLER, special=False)))
    if not pool:
        raise RuntimeError(f"{source.name} returned no tokens for the filler text")
    return pool
