"""The sampler: draws tokens from fp32 logits as :class:`SamplingParams` say.

:class:`SamplingParams` (and the plain data below) live in
:mod:`medha_runtime.sampling_params`, which needs no torch; they are
re-exported here. The engine turns a request's params into a
:class:`SampleSpec` for every row it samples, and :class:`Sampler` (on the
sampling rank: the last stage's first rank) draws:

1. tokens outside ``allowed_token_ids`` and one-token ``bad_words`` get -inf
   (a mask built once per request); ``logit_bias`` is added and ``suppress``
   ed tokens (stop tokens before ``min_tokens``) get -inf; a longer bad
   word's last token gets -inf where the output ends with the rest of it
   (unless it is the only token left to draw); then the penalties, over the
   token counts the sampler keeps per request (prompt and output for
   ``repetition_penalty``, output for ``presence_penalty`` and
   ``frequency_penalty``). The bias and penalties are batched over the rows
   as ``[S, V]`` tensors;
2. a temperature below ``1e-5`` (0 included) is greedy: the arg-max token;
3. otherwise the logits are divided by the temperature, tokens below
   ``min_p`` times the most likely one's probability are dropped, then
   ``top_k`` then ``top_p`` filter, and one token is drawn with the request's
   own ``torch.Generator`` (seeded from ``seed``, or from the engine's seed
   and the request's serial number when ``seed`` is None). Each row is drawn
   with its own generator, so a seeded request gives the same tokens whatever
   else is in the batch;
4. a chosen token's logprob is ``log_softmax`` of the raw logits, before
   step 1 (vLLM's default ``logprobs_mode``, ``raw_logprobs``; OpenAI's
   logprobs do not move with the temperature either): the model's own
   distribution, whatever the temperature, filters, bias or penalties.
   ``logprobs=k > 0`` also returns the ``k`` most likely tokens of it.

Prompt logprobs (:meth:`Sampler.prompt_logprobs`) are ``log_softmax`` of the
raw logits at every prompt position, as a teacher-forced forward gives them.
Stop conditions (stop strings, stop token ids, EOS, ``max_tokens``) are
checked by the engine after sampling. A row that cannot be sampled (non-finite
logits make ``torch.multinomial`` raise) gets ``Sampled.error`` instead of
stopping the step (see :meth:`Sampler.sample`); the engine ends its request with
``finish_reason="error"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from medha_kernels import row_argmax
from medha_runtime.sampling_params import (
    GREEDY_EPS,
    Penalties,
    PromptLogprobs,
    PromptLogprobSpec,
    Sampled,
    SampleSpec,
    SamplingParams,
)

__all__ = [
    "GREEDY_EPS",
    "Penalties",
    "PromptLogprobSpec",
    "PromptLogprobs",
    "SampleSpec",
    "Sampled",
    "Sampler",
    "SamplingParams",
]


@dataclass
class _History:
    """A penalized request's token counts on the sampling rank.

    ``output``: fp32 ``[V]`` occurrences in the output; ``seen``: bool ``[V]``
    tokens of the prompt or the output.
    """

    output: torch.Tensor
    seen: torch.Tensor


@dataclass
class _Bans:
    """A request's banned tokens on the sampling rank (built from its first row).

    ``mask``: bool ``[V]``, True for a token never drawn (outside
    ``allowed`` or a one-token bad word; None: no such token); ``words``: the
    bad words of more than one token, indexed by their length less one, then by
    all but their last token, to those last tokens (a step looks up each length
    once, however many words); ``tail``: the output's last tokens (``keep``: the
    longest word's length less one). ``allowed`` and ``bad_words`` are the
    spec's, to notice a request id used anew.
    """

    allowed: tuple[int, ...]
    bad_words: tuple[tuple[int, ...], ...]
    mask: torch.Tensor | None
    words: dict[int, dict[tuple[int, ...], list[int]]]
    tail: list[int]
    keep: int

    def matches(self, spec: SampleSpec) -> bool:
        return (self.allowed is spec.allowed or self.allowed == spec.allowed) and (
            self.bad_words is spec.bad_words or self.bad_words == spec.bad_words
        )

    def word_ends(self) -> list[int]:
        """Last tokens of the words whose rest the output ends with."""
        tail, n = self.tail, len(self.tail)
        ends: list[int] = []
        for k, by_prefix in self.words.items():
            if k <= n:
                ends.extend(by_prefix.get(tuple(tail[n - k :]), ()))
        return ends


class Sampler:
    """Draws tokens from logits; keeps one generator per request and the token
    counts of penalized requests.

    Call :meth:`forget` when requests finish so their state is dropped.
    """

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._histories: dict[str, _History] = {}
        self._bans: dict[str, _Bans] = {}

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._histories.pop(rid, None)
            self._bans.pop(rid, None)

    def _generator(self, spec: SampleSpec, device: torch.device) -> torch.Generator:
        g = self._generators.get(spec.request_id)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(spec.seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[spec.request_id] = g
        return g

    def _history(self, spec: SampleSpec, vocab: int, device: torch.device) -> _History:
        h = self._histories.get(spec.request_id)
        if spec.history is not None:  # (re)start from the engine's record
            prompt, output = spec.history
            counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if output:
                out_ids = torch.tensor(output, dtype=torch.int64, device=device)
                counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
                seen[out_ids] = True
            if prompt:
                seen[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
            h = self._histories[spec.request_id] = _History(counts, seen)
        if h is None:
            raise RuntimeError(
                f"request {spec.request_id!r}: penalties without its token history "
                "(the engine sends it with the first penalized row)"
            )
        return h

    @torch.no_grad()
    def process(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
        """Step 1 of the module docstring on fp32 ``[S, V]`` logits.

        Returns a new fp32 ``[S, V]`` tensor when a row has a bias, a suppressed
        token, allowed tokens, bad words or penalties; otherwise ``logits`` itself
        (nothing to change).
        """
        if not any(
            s.logit_bias or s.suppress or s.allowed or s.bad_words or s.penalties is not None
            for s in specs
        ):
            return logits.float()
        logits = logits.float().clone()
        vocab, device = logits.shape[1], logits.device
        bans = {
            i: self._request_bans(s, vocab, device)
            for i, s in enumerate(specs)
            if s.allowed or s.bad_words
        }
        for i, b in bans.items():  # before the bias and penalties, which keep -inf
            if b.mask is not None:
                logits[i].masked_fill_(b.mask, float("-inf"))
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        for i, s in enumerate(specs):
            for tok, b in s.logit_bias:
                bias_r.append(i)
                bias_t.append(tok)
                bias_v.append(b)
            for tok in s.suppress:
                bias_r.append(i)
                bias_t.append(tok)
                bias_v.append(float("-inf"))
        if bias_r:
            index = (
                torch.tensor(bias_r, dtype=torch.int64, device=device),
                torch.tensor(bias_t, dtype=torch.int64, device=device),
            )
            logits.index_put_(index, torch.tensor(bias_v, device=device), accumulate=True)
        for i, b in bans.items():
            ends = b.word_ends() if b.words else None
            if ends:
                _ban_unless_last(logits[i], ends)
        pen = [i for i, s in enumerate(specs) if s.penalties is not None]
        if pen:
            hist = [self._history(specs[i], vocab, device) for i in pen]
            counts = torch.stack([h.output for h in hist])  # [P, V]
            seen = torch.stack([h.seen for h in hist])  # [P, V]
            params = torch.tensor(
                [specs[i].penalties for i in pen], dtype=torch.float32, device=device
            )  # [P, 3]: presence, frequency, repetition
            presence, frequency, repetition = (params[:, j : j + 1] for j in range(3))
            sub = logits[pen]
            rep = torch.where(sub > 0, sub / repetition, sub * repetition)
            if any(not _SAFE_PENALTY[0] <= specs[i].penalties.repetition <= _SAFE_PENALTY[1]
                   for i in pen):  # fmt: skip
                rep = _bounded(rep, sub)
            sub = torch.where(seen, rep, sub)
            sub = sub - frequency * counts - presence * (counts > 0).float()
            logits[pen] = sub
        return logits

    def _request_bans(self, spec: SampleSpec, vocab: int, device: torch.device) -> _Bans:
        """The request's :class:`_Bans`, built on its first row (and anew for a request
        id used again); a row with ``history`` restarts the output's tail from it."""
        b = self._bans.get(spec.request_id)
        if b is None or not b.matches(spec):
            words: dict[int, dict[tuple[int, ...], list[int]]] = {}
            for w in spec.bad_words:
                if len(w) > 1:
                    words.setdefault(len(w) - 1, {}).setdefault(w[:-1], []).append(w[-1])
            keep = max(words, default=0)
            mask = _token_mask(spec, vocab, device)
            b = self._bans[spec.request_id] = _Bans(
                spec.allowed, spec.bad_words, mask, words, [], keep
            )
        if spec.history is not None and b.words:
            b.tail[:] = spec.history[1][-b.keep :]
        return b

    def _count(self, specs: Sequence[SampleSpec], tokens: Sequence[int]) -> None:
        """Add each penalized row's new token to its request's counts, and each row
        with longer bad words' token to its request's tail."""
        for s, tok in zip(specs, tokens, strict=True):
            if s.penalties is not None:
                h = self._histories[s.request_id]
                h.output[tok] += 1
                h.seen[tok] = True
            if s.bad_words:
                b = self._bans[s.request_id]
                if b.words:
                    b.tail.append(tok)
                    del b.tail[: -b.keep]

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[Sampled]:
        """One token per row of ``logits`` (fp32 ``[S, V]``), row ``i`` by ``specs[i]``.

        An exception while sampling the batch does not escape: the rows not sampled
        yet are retried one by one, and a row that fails alone gets a
        :class:`Sampled` with ``error`` set. The others get the tokens an error-free
        batch gives them (rows are independent; a row drawn before the failure keeps
        its token, so no generator draws twice), and the penalty and bad-word state
        counts each sampled row once.
        """
        if logits.dim() != 2 or logits.shape[0] != len(specs):
            raise ValueError(
                f"expected logits [{len(specs)}, vocab] for {len(specs)} rows, "
                f"got {tuple(logits.shape)}"
            )
        out: list[Sampled | None] = [None] * len(specs)
        try:
            self._sample(logits, specs, out)
        except Exception:
            done = [i for i, r in enumerate(out) if r is not None]  # not counted yet
            for i, spec in enumerate(specs):
                if out[i] is None:
                    out[i] = self._sample_alone(logits[i : i + 1], spec)
            self._count([specs[i] for i in done], [out[i].token_id for i in done])  # type: ignore[union-attr]
        return out  # type: ignore[return-value]

    def _sample_alone(self, logits: torch.Tensor, spec: SampleSpec) -> Sampled:
        """One row (fp32 ``[1, V]``) sampled by itself; an exception becomes its error."""
        out: list[Sampled | None] = [None]
        try:
            self._sample(logits, [spec], out)
        except Exception as exc:
            return Sampled(0, error=f"sampling failed: {type(exc).__name__}: {exc}")
        assert out[0] is not None
        return out[0]

    def _sample(
        self, logits: torch.Tensor, specs: Sequence[SampleSpec], out: list[Sampled | None]
    ) -> None:
        """Fill ``out[i]`` for row ``i`` of fp32 ``[S, V]`` logits, row after row, then
        count them (an exception leaves the rows sampled so far filled, uncounted)."""
        if all(_plain_greedy(s) for s in specs):  # a decode batch's usual case: the arg-max
            out[:] = [Sampled(tok) for tok in _greedy_tokens(logits.float())]
            return
        # logprobs are of the raw logits (step 4), so taken before they are processed
        lp_rows = [i for i, s in enumerate(specs) if s.logprobs is not None]
        raw_lp: dict[int, torch.Tensor] = {}
        if lp_rows:
            lp = torch.log_softmax(logits[lp_rows].float(), dim=-1)
            raw_lp = {i: lp[j] for j, i in enumerate(lp_rows)}
        logits = self.process(logits, specs)
        greedy_rows = [i for i, s in enumerate(specs) if s.greedy]
        if greedy_rows:
            g_logits = logits if len(greedy_rows) == len(specs) else logits[greedy_rows]
            greedy_ids = _greedy_tokens(g_logits)
            for j, i in enumerate(greedy_rows):
                spec, tok = specs[i], greedy_ids[j]
                if spec.logprobs is None:
                    out[i] = Sampled(tok)
                else:
                    out[i] = _with_logprobs(raw_lp[i], tok, spec)
        drawn = [i for i, s in enumerate(specs) if not s.greedy]
        if drawn:
            temps = torch.tensor(
                [specs[i].temperature for i in drawn], dtype=torch.float32, device=logits.device
            )
            scaled = logits[drawn] / temps[:, None]
            if any(specs[i].temperature > _SAFE_TEMPERATURE for i in drawn):
                scaled = _bounded(scaled, logits[drawn])
            scaled = _min_p(scaled, [specs[i].min_p for i in drawn])
            for j, i in enumerate(drawn):
                spec = specs[i]
                row = _filter(scaled[j], spec.top_k, spec.top_p)
                probs = torch.softmax(row, dim=-1)
                g = self._generator(spec, row.device)
                tok = int(torch.multinomial(probs, 1, generator=g))
                if spec.logprobs is None:
                    out[i] = Sampled(tok)
                else:
                    out[i] = _with_logprobs(raw_lp[i], tok, spec)
        self._count(specs, [r.token_id for r in out])  # type: ignore[union-attr]

    @torch.no_grad()
    def prompt_logprobs(
        self, logits: torch.Tensor, request_id: str, start: int, spec: PromptLogprobSpec
    ) -> PromptLogprobs:
        """Logprobs of ``spec.targets`` from fp32 ``[len(targets), V]`` logits."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(spec.targets, dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in spec.targets]
        if spec.top:
            values, ids = torch.topk(lp, min(spec.top, lp.shape[-1]), dim=-1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        entries = []
        for tok, value, top in zip(spec.targets, chosen, tops, strict=True):
            entry = {tok: value}
            for alt, alt_lp in top:
                entry.setdefault(alt, alt_lp)
            entries.append(entry)
        return PromptLogprobs(request_id, start, tuple(entries))


def _plain_greedy(spec: SampleSpec) -> bool:
    """Greedy with nothing to change in the logits and no logprobs: the token is the arg-max
    (what :meth:`Sampler.sample`'s general path gives such a row, with nothing to count)."""
    return (
        spec.greedy
        and spec.logprobs is None
        and spec.penalties is None
        and not spec.logit_bias
        and not spec.suppress
        and not spec.allowed
        and not spec.bad_words
    )


def _token_mask(spec: SampleSpec, vocab: int, device: torch.device) -> torch.Tensor | None:
    """bool ``[V]``: True for the tokens a request never draws (outside ``spec.allowed``,
    or a one-token bad word); None when there is none."""
    single = [w[0] for w in spec.bad_words if len(w) == 1]
    if not spec.allowed and not single:
        return None
    mask = torch.full((vocab,), bool(spec.allowed), dtype=torch.bool, device=device)
    if spec.allowed:
        mask[torch.tensor(spec.allowed, dtype=torch.int64, device=device)] = False
    if single:
        mask[torch.tensor(single, dtype=torch.int64, device=device)] = True
    return mask


def _ban_unless_last(row: torch.Tensor, tokens: list[int]) -> None:
    """Set ``tokens`` of fp32 ``[V]`` logits to -inf, unless that leaves none finite
    (a longer bad word's last token that is the only one left is still drawn)."""
    index = torch.tensor(tokens, dtype=torch.int64, device=row.device)
    left = row > float("-inf")
    left[index] = False
    if bool(left.any()):
        row[index] = float("-inf")


#: repetition penalties and temperatures within which fp32 logits (below ~1e8) cannot
#: overflow or meet inf (fp32's largest is 3.4e38): outside them :func:`_bounded` runs
#: (five passes over the rows, 30% of a 32-row sampling step on a CPU)
_SAFE_PENALTY = (1e-30, 1e30)
_SAFE_TEMPERATURE = 1e38


def _bounded(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` (fp32 ``[S, V]``, ``old`` after a repetition penalty or over the temperature)
    finite where ``old`` was: an extreme but valid value (a penalty of 1e-300, which fp32
    holds as 0; a temperature of 1e300) overflows a logit to +-inf, or gives NaN (0 x inf,
    -inf / inf), and softmax of such a row is NaN, which stopped the engine. An overflow
    becomes the largest (or smallest) float, so that token stays the most (least) likely;
    NaN becomes 0, the limit of a 0 logit's penalty; a -inf of ``old`` (a token ruled out)
    stays -inf."""
    big = torch.finfo(new.dtype).max
    return torch.where(
        torch.isfinite(old), torch.nan_to_num(new, nan=0.0, posinf=big, neginf=-big), old
    )


def _min_p(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens below ``min_p`` x the top probability, per row of ``[S, V]`` scaled logits."""
    if not any(min_p):
        return scaled
    mp = torch.tensor(min_p, dtype=torch.float32, device=scaled.device)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    top = probs.max(dim=-1, keepdim=True).values
    return scaled.masked_fill(probs < mp * top, float("-inf"))


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


def sample_step(
    sampler: Sampler, logits: torch.Tensor, chunks: Sequence[object]
) -> list[Sampled | PromptLogprobs]:
    """Split a step's logits (fp32, rows in :func:`logit_rows` order) and answer them.

    Returns one :class:`Sampled` per sampled chunk, in chunk order, then one
    :class:`PromptLogprobs` per chunk that asked for prompt logprobs.
    """
    sample_rows: list[int] = []
    specs: list[SampleSpec] = []
    prompts: list[PromptLogprobs] = []
    row = 0
    for c in chunks:
        pl: PromptLogprobSpec | None = getattr(c, "prompt_logprobs", None)
        if pl is not None and pl.targets:
            n = len(pl.targets)
            prompts.append(
                sampler.prompt_logprobs(logits[row : row + n], c.request_id, c.start, pl)  # type: ignore[attr-defined]
            )
            row += n
        if c.sample is not None:  # type: ignore[attr-defined]
            sample_rows.append(row)
            specs.append(c.sample)  # type: ignore[attr-defined]
            row += 1
    if row != logits.shape[0]:
        raise RuntimeError(f"{logits.shape[0]} logit rows for a step that needs {row}")
    sampled: list[Sampled | PromptLogprobs] = []
    if specs:
        every_row = len(sample_rows) == row  # then sample_rows is 0, 1, ..., row - 1
        sampled.extend(sampler.sample(logits if every_row else logits[sample_rows], specs))
    return sampled + prompts


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The arg-max of each row of fp32 ``[S, V]`` logits: int64 ``[S]``, the first
    maximal index on ties (as ``argmax``).

    :func:`medha_kernels.row_argmax`: one native pass a row for fp32 CPU logits,
    else ``max(dim=-1)``, which gives the same indices as ``argmax(dim=-1)`` and,
    on the CPU, in about a third of the time at 8 to 32 rows of a 49K
    vocabulary (torch 2.13: 1.70 against 5.41 ms at 32 rows, one thread).
    """
    return row_argmax(logits)


def _greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The arg-max token of each row of fp32 ``[S, V]`` logits (:func:`greedy_argmax`).

    Raises ValueError where a row's largest logit is NaN (the model's output is
    not finite: the arg-max counts NaN as the largest) or -inf (every token is
    ruled out), so that :meth:`Sampler.sample` gives that row an error, as a drawn
    row gets one from ``torch.multinomial``. One host read, as before.
    """
    ids = greedy_argmax(logits)
    best = logits.gather(1, ids[:, None])[:, 0]
    pairs = torch.stack([ids.double(), best.double()], dim=1).tolist()
    for _, value in pairs:
        if math.isnan(value) or value == -math.inf:
            why = "not finite" if math.isnan(value) else "-inf: every token is ruled out"
            raise ValueError(f"no token can be chosen: the largest logit is {why}")
    return [int(tok) for tok, _ in pairs]


def logit_rows(chunk: object, first_row: int) -> list[int]:
    """The token rows of one chunk whose logits a step needs (see :func:`sample_step`).

    ``first_row`` is the chunk's first row in the batch.
    """
    rows: list[int] = []
    pl: PromptLogprobSpec | None = getattr(chunk, "prompt_logprobs", None)
    if pl is not None:
        rows.extend(range(first_row, first_row + len(pl.targets)))
    if chunk.sample is not None:  # type: ignore[attr-defined]
        rows.append(first_row + len(chunk.token_ids) - 1)  # type: ignore[attr-defined]
    return rows
