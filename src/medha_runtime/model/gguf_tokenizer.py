"""The tokenizer a GGUF file describes, rebuilt with the ``tokenizers`` library.

A GGUF carries no ``tokenizer.json``; its metadata holds what llama.cpp needs:

- ``tokenizer.ggml.model``: ``"gpt2"`` (byte-level BPE) is supported;
- ``tokenizer.ggml.tokens`` / ``merges``: the vocabulary (in GPT-2's
  byte-to-unicode spelling) and the merge list;
- ``tokenizer.ggml.token_type``: control tokens (3) become special added
  tokens, user-defined ones (4) plain added tokens, both matched whole;
- ``tokenizer.ggml.pre``: which text splitting the merges were learned with
  (:data:`PRE_SPLITS`, the regexes llama.cpp uses for each name);
- ``tokenizer.ggml.{bos,eos,eot}_token_id``, ``add_bos_token`` /
  ``add_eos_token``, and ``tokenizer.chat_template``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, processors

from medha_runtime.model.errors import ConfigError, UnsupportedModelError
from medha_runtime.tokenizer import bytes_to_unicode

if TYPE_CHECKING:
    from medha_runtime.model.gguf import GGUFCheckpoint
    from medha_runtime.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` → (splits applied before GPT-2's own, whether BPE ignores merges
#: for whole-word vocabulary hits). ``None`` means GPT-2's byte-level regex alone.
PRE_SPLITS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "gpt-2": (None, False),
    # each digit on its own, then GPT-2's regex (SmolLM, StarCoder and relatives)
    "smollm": (r"\p{N}", False),
    "starcoder": (r"\p{N}", False),
    "refact": (r"\p{N}", False),
    "codeshell": (r"\p{N}", False),
    "llama3": (_LLAMA3, True),
    "llama-v3": (_LLAMA3, True),
    "llama-bpe": (_LLAMA3, True),
    "smaug-bpe": (_LLAMA3, True),
    "dbrx": (_LLAMA3, True),
    "qwen2": (_QWEN2, False),
}


def build_gguf_tokenizer(ckpt: GGUFCheckpoint) -> Tokenizer:
    """The file's tokenizer, chat template and stop ids.

    Raises:
        ConfigError: the metadata has no tokenizer (or an incomplete one), named.
        UnsupportedModelError: a tokenizer model or pre-tokenizer not supported here.
    """
    from medha_runtime.tokenizer import Tokenizer

    meta, where = ckpt.metadata, ckpt.path
    kind = meta.get("tokenizer.ggml.model")
    tokens = ckpt.array("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ConfigError(
            f"{where}: no tokenizer in the GGUF metadata ('tokenizer.ggml.model' and "
            "'tokenizer.ggml.tokens' are required)"
        )
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{where}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    merges = ckpt.array("tokenizer.ggml.merges")
    if merges is None:
        raise ConfigError(f"{where}: byte-level BPE without 'tokenizer.ggml.merges'")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise UnsupportedModelError(
            f"{where}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
            f"known: {', '.join(PRE_SPLITS)}"
        )
    split, ignore_merges = PRE_SPLITS[pre]
    tok = tokenizers.Tokenizer(
        models.BPE(
            vocab=_byte_level_vocab(tokens),
            merges=[tuple(m.split(" ", 1)) for m in merges],
            ignore_merges=ignore_merges,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split is None:
        tok.pre_tokenizer = byte_level
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
            if split != r"\p{N}"
            else [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    types = ckpt.array("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [
            tokenizers.AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            return None
        if not 0 <= i < len(tokens):
            raise ConfigError(
                f"{where}: tokenizer.ggml.{key}_token_id={i} is outside the vocabulary"
            )
        return tokens[i]

    bos, eos = token("bos"), token("eos")
    _add_post_processor(tok, meta, bos, eos, where)
    stops = [
        meta[k]
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if k in meta
    ]
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(
        tok,
        bos_token=bos,
        eos_token=eos,
        chat_template=template if isinstance(template, str) else None,
        generation_eos_ids=[int(s) for s in stops],
    )


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token → id; a token not spelled in the byte alphabet is respelled from its UTF-8."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    return vocab


def _add_post_processor(
    tok: tokenizers.Tokenizer, meta: dict, bos: str | None, eos: str | None, where: object
) -> None:
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return
    for flag, token, name in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and token is None:
            raise ConfigError(f"{where}: add_{name}_token is set but there is no {name} token id")
    head = f"{bos} " if add_bos else ""
    tail = f" {eos}" if add_eos else ""
    specials = {
        t: tok.token_to_id(t) for t in (bos if add_bos else None, eos if add_eos else None) if t
    }
    tok.post_processor = processors.TemplateProcessing(
        single=f"{head}$A{tail}",
        pair=f"{head}$A{tail} {head}$B{tail}".replace("  ", " ").strip(),
        special_tokens=list(specials.items()),
    )
