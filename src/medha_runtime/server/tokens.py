"""The HTTP process's tokenizer, built from the engine's plain data (no torch, no checkpoint).

:class:`FrontTokenizer` wraps :class:`~medha_runtime.tokenizer.Tokenizer` and
adds what the OpenAI formats need per token:

- :meth:`FrontTokenizer.token_bytes`: the token's own bytes (a byte-level
  BPE token's characters mapped back to bytes, a ``<0xNN>`` byte-fallback
  piece as that byte, ``▁`` as a space, a special token as its text);
- :meth:`FrontTokenizer.token_str`: those bytes as text, or, when they are
  not valid UTF-8 on their own (part of a character), ``bytes:\\xe2\\x80``
  as OpenAI writes such tokens. Distinct tokens get distinct strings, so
  ``top_logprobs`` keyed by them lose no entry.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import tokenizers

from medha_runtime.server.messages import TokenizerData
from medha_runtime.tokenizer import Tokenizer, bytes_to_unicode

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

#: texts of more characters than this are encoded with ``encode_batch``, which releases
#: the GIL (``encode`` holds it throughout: seconds for a 4 MB prompt), and the server
#: encodes them on a worker thread, so the event loop and every other stream go on
LONG_TEXT_CHARS = 1 << 16


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _decoder_kinds(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    kinds = {str(decoder.get("type"))}
    for d in decoder.get("decoders") or ():
        kinds |= _decoder_kinds(d)
    return kinds


class FrontTokenizer:
    """A :class:`Tokenizer` plus per-token bytes and strings (see the module docstring)."""

    def __init__(self, data: TokenizerData) -> None:
        self.tokenizer = Tokenizer(
            tokenizers.Tokenizer.from_str(data.json),
            bos_token=data.bos_token,
            eos_token=data.eos_token,
            chat_template=data.chat_template,
            generation_eos_ids=data.stop_token_ids,
        )
        raw = self.tokenizer.tokenizer
        self._kinds = _decoder_kinds(json.loads(data.json).get("decoder"))
        self._added = {i: t.content for i, t in raw.get_added_tokens_decoder().items()}
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)
        self.token_str = functools.lru_cache(maxsize=1 << 16)(self._token_str)

    # the Tokenizer's own API
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        raw = self.tokenizer.tokenizer  # the same ids, without the GIL held
        return raw.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, *args: Any, tokenize: bool = False, **kwargs: Any) -> Any:
        """The Tokenizer's, with the rendered text encoded by :meth:`encode` (as it
        does: no special tokens added)."""
        text = self.tokenizer.apply_chat_template(*args, tokenize=False, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if "ByteLevel" in self._kinds:
            return (
                bytes(_UNICODE_TO_BYTE.get(ch, 0) for ch in piece)
                if all(ch in _UNICODE_TO_BYTE for ch in piece)
                else piece.encode()
            )
        if "ByteFallback" in self._kinds or "Metaspace" in self._kinds or "Replace" in self._kinds:
            m = _BYTE_PIECE.match(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def _token_str(self, token_id: int) -> str:
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
