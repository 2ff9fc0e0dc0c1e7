"""Sampling parameters (vLLM's names and defaults) and the sampler that applies them.

:class:`SamplingParams` is what a user passes per prompt. The engine turns it
into a :class:`SampleSpec` for every row it samples (plain data that travels to
the worker that samples), and :class:`Sampler` draws tokens from fp32 logits:

- ``temperature`` below ``1e-5`` (0 included) is greedy: the arg-max token;
- otherwise the logits are divided by the temperature, filtered by ``top_k``
  then ``top_p``, and one token is drawn with the request's own
  ``torch.Generator`` (seeded from ``seed``, or from the engine's seed and the
  request's serial number when ``seed`` is None). Each row is drawn
  separately, so a seeded request gives the same tokens whatever else is in
  the batch;
- a chosen token's logprob is ``log_softmax`` of the distribution it was drawn
  from (temperature-scaled and filtered); for greedy rows, of the raw logits.
  ``logprobs=k > 0`` also returns the ``k`` most likely tokens of that
  distribution.

Stop conditions (stop strings, stop token ids, EOS, ``max_tokens``) are
checked by the engine after sampling; ``min_tokens`` also suppresses the stop
tokens here (their logits are set to -inf) until it is reached.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

#: temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)
GREEDY_EPS = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one prompt's completion (vLLM's names and defaults).

    Attributes:
        temperature: 0 (or below 1e-5) is greedy; higher flattens the distribution.
        top_p: keep the smallest set of most likely tokens whose probability
            reaches ``top_p``, in (0, 1]; 1 keeps everything.
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps everything.
        seed: seeds this request's own generator (reproducible whatever the
            batch); None draws a seed from the engine's seed.
        max_tokens: most tokens to generate (>= 1). The engine lowers it so
            prompt plus output fit the model's context.
        min_tokens: stop tokens are suppressed and stop strings ignored until
            this many tokens exist (<= max_tokens).
        stop: strings that end generation; the text is cut before the match
            (unless ``include_stop_str_in_output``). A single string is allowed.
        stop_token_ids: token ids that end generation (even with ``ignore_eos``).
        ignore_eos: keep going past the model's EOS tokens (until max_tokens).
        logprobs: None for none; 0 for the chosen tokens' logprobs; ``k > 0``
            adds the ``k`` most likely tokens at each step.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string in the text.

    ``stop`` and ``stop_token_ids`` are stored as tuples.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= 1, or 0 or -1 to disable it, got {self.top_k!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
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
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)  # type: ignore[arg-type]


class SampleSpec(NamedTuple):
    """How to sample one row: what the sampling worker needs (plain data).

    ``seed`` is always set (the engine derives one for unseeded requests);
    ``suppress`` lists token ids whose logits are set to -inf (stop tokens
    before ``min_tokens``).
    """

    request_id: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int | None
    suppress: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class Sampled(NamedTuple):
    """One sampled token: its id, its logprob (None unless asked) and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Draws tokens from logits; keeps one generator per (seeded) request.

    Call :meth:`forget` when requests finish so their generators are dropped.
    """

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, spec: SampleSpec, device: torch.device) -> torch.Generator:
        g = self._generators.get(spec.request_id)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(spec.seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[spec.request_id] = g
        return g

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[Sampled]:
        """One token per row of ``logits`` (fp32 ``[S, V]``), row ``i`` by ``specs[i]``."""
        if logits.dim() != 2 or logits.shape[0] != len(specs):
            raise ValueError(
                f"expected logits [{len(specs)}, vocab] for {len(specs)} rows, "
                f"got {tuple(logits.shape)}"
            )
        logits = logits.float()
        out: list[Sampled] = []
        greedy_rows = [i for i, s in enumerate(specs) if s.greedy]
        greedy_ids: list[int] = []
        if greedy_rows:
            g_logits = logits[greedy_rows]
            for j, i in enumerate(greedy_rows):
                if specs[i].suppress:
                    g_logits[j, list(specs[i].suppress)] = float("-inf")
            greedy_ids = g_logits.argmax(dim=-1).tolist()
        by_row: dict[int, Sampled] = {}
        for j, i in enumerate(greedy_rows):
            spec = specs[i]
            tok = greedy_ids[j]
            if spec.logprobs is None:
                by_row[i] = Sampled(tok)
            else:
                by_row[i] = _with_logprobs(torch.log_softmax(g_logits[j], dim=-1), tok, spec)
        for i, spec in enumerate(specs):
            if i in by_row:
                out.append(by_row[i])
                continue
            row = logits[i] / spec.temperature
            if spec.suppress:
                row[list(spec.suppress)] = float("-inf")
            row = _filter(row, spec.top_k, spec.top_p)
            probs = torch.softmax(row, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=self._generator(spec, row.device)))
            if spec.logprobs is None:
                out.append(Sampled(tok))
            else:
                out.append(_with_logprobs(torch.log_softmax(row, dim=-1), tok, spec))
        return out


def _filter(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p filtering of one row of (scaled) logits: others become -inf."""
    vocab = row.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop = before >= top_p
        drop[0] = False  # the most likely token always stays
        row = row.clone()
        row[order[drop]] = float("-inf")
    return row


def _with_logprobs(logprobs: torch.Tensor, token: int, spec: SampleSpec) -> Sampled:
    chosen = float(logprobs[token])
    top: tuple[tuple[int, float], ...] = ()
    if spec.logprobs:
        k = min(spec.logprobs, logprobs.shape[-1])
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return Sampled(token, chosen, top)
