"""A tiny deterministic causal transformer for parallelism tests.

Pre-norm decoder (fp32, CPU): token embedding plus sinusoidal positions, then
``n_layers`` blocks of ``x += Wo·attn(norm(x))`` and ``x += W2·silu(W1·norm(x))``.
Attention is :func:`medha_kernels.chunked_prefill_attention` (torch backend)
over a per-layer KV cache that grows chunk by chunk, with ``q_offset=start_pos``.

Weights depend only on :class:`ToyConfig` (seeded), so every rank builds the
same model. Typical use::

    model = ToyModel(ToyConfig())
    ref = model.forward_full(tokens)                  # single-process oracle
    stage = model.make_stage(0, num_stages=2)         # layers 0..1 + their KV cache
    h = model.forward_stage(stage, model.embed(tokens[:8], 0), start_pos=0)

Hooks for other parallel schemes: ``model.layers[l]`` holds the weights
(:class:`LayerWeights`, for TP sharding) and ``forward_layers(..., attend=fn)``
replaces the cache-plus-attention step (for KVP), where
``fn(layer, q, k, v, start_pos) -> o`` takes this chunk's ``[n, heads, head_dim]``
tensors. ``compute_weight=n`` adds ``n`` discarded ``[num_tokens, burn_dim] x
[burn_dim, burn_dim]`` matmuls per layer: more compute, same outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from medha_kernels import chunked_prefill_attention

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 64
    d_model: int = 16
    n_layers: int = 4
    n_heads: int = 2
    d_ff: int = 32
    seed: int = 0
    compute_weight: int = 0
    burn_dim: int = 256

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class LayerWeights:
    """One block: ``[d_model, d_model]`` projections and the MLP (``x @ W`` convention)."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w1: torch.Tensor  # [d_model, d_ff]
    w2: torch.Tensor  # [d_ff, d_model]


@dataclass
class KVCache:
    """Per-layer K and V (``[num_tokens, n_heads, head_dim]``), appended chunk by chunk."""

    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)

    def length(self, layer: int) -> int:
        return self.k[layer].shape[0] if layer in self.k else 0

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int
    ) -> torch.Tensor:
        """Append this chunk's K/V to ``layer`` and attend causally over the whole cache."""
        if self.length(layer) != start_pos:
            raise ValueError(
                f"layer {layer}: cache holds {self.length(layer)} tokens but the chunk "
                f"starts at {start_pos} (chunks out of order?)"
            )
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k]), torch.cat([self.v[layer], v])
        self.k[layer], self.v[layer] = k, v
        o, _ = chunked_prefill_attention(q, k, v, q_offset=start_pos, backend="torch")
        return o


@dataclass
class ToyStage:
    """A pipeline stage: a contiguous range of layers and the KV cache for them."""

    index: int
    layers: range
    cache: KVCache = field(default_factory=KVCache)


def stage_ranges(n_layers: int, num_stages: int) -> list[range]:
    """Split layers into ``num_stages`` contiguous ranges, the first ones one longer."""
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {num_stages} stages")
    base, extra = divmod(n_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (s < extra)
        out.append(range(lo, hi))
        lo = hi
    return out


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ToyModel:
    def __init__(self, cfg: ToyConfig | None = None) -> None:
        self.cfg = cfg = cfg or ToyConfig()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        g = torch.Generator().manual_seed(cfg.seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=g) / math.sqrt(rows)

        d = cfg.d_model
        self.tok_emb = torch.randn(cfg.vocab, d, generator=g)
        self.layers = [
            LayerWeights(w(d, d), w(d, d), w(d, d), w(d, d), w(d, cfg.d_ff), w(cfg.d_ff, d))
            for _ in range(cfg.n_layers)
        ]
        # Drawn last, so compute_weight and burn_dim leave the model's weights unchanged.
        self._burn = w(cfg.burn_dim, cfg.burn_dim) if cfg.compute_weight else None

    def to(self, dtype: torch.dtype) -> ToyModel:
        """The same model with every weight cast to ``dtype`` (float64: a reference)."""
        out = ToyModel.__new__(ToyModel)
        out.cfg, out._burn = self.cfg, self._burn
        out.tok_emb = self.tok_emb.to(dtype)
        out.layers = [LayerWeights(*(w.to(dtype) for w in vars(p).values())) for p in self.layers]
        return out

    # -- pieces -------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """``[n]`` int64 token ids at absolute positions ``start_pos..`` -> ``[n, d_model]``."""
        d, dtype = self.cfg.d_model, self.tok_emb.dtype
        pos = torch.arange(start_pos, start_pos + tokens.shape[0], dtype=dtype)
        freq = torch.exp(torch.arange(0, d, 2, dtype=dtype) * (-math.log(1e4) / d))
        angles = pos[:, None] * freq[None, :]
        pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)
        return self.tok_emb[tokens] + pe

    def forward_layer(
        self, layer: int, x: torch.Tensor, start_pos: int, attend: Attend
    ) -> torch.Tensor:
        cfg, p = self.cfg, self.layers[layer]
        n = x.shape[0]
        h = _rms_norm(x)
        q, k, v = ((h @ wt).view(n, cfg.n_heads, cfg.head_dim) for wt in (p.wq, p.wk, p.wv))
        x = x + attend(layer, q, k, v, start_pos).reshape(n, cfg.d_model) @ p.wo
        x = x + torch.nn.functional.silu(_rms_norm(x) @ p.w1) @ p.w2
        self._burn_compute(n)
        return x

    def _burn_compute(self, n: int) -> None:
        if self._burn is None:
            return
        a = torch.full((n, self.cfg.burn_dim), 0.5)
        out = torch.empty_like(a)
        for _ in range(self.cfg.compute_weight):
            torch.mm(a, self._burn, out=out)

    def forward_layers(
        self,
        x: torch.Tensor,
        layers: Sequence[int],
        start_pos: int,
        *,
        cache: KVCache | None = None,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        """Run ``layers`` on one chunk ``x`` ``[n, d_model]`` at ``start_pos``."""
        if attend is None:
            if cache is None:
                raise ValueError("give a cache or an attend function")
            attend = cache.attend
        for layer in layers:
            x = self.forward_layer(layer, x, start_pos, attend)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_norm(h) @ self.tok_emb.T

    # -- stages and oracles -------------------------------------------------------
    def make_stage(self, index: int, num_stages: int) -> ToyStage:
        return ToyStage(index, stage_ranges(self.cfg.n_layers, num_stages)[index])

    def forward_stage(self, stage: ToyStage, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """The stage's layers on one chunk; appends the chunk's KV to ``stage.cache``."""
        return self.forward_layers(x, stage.layers, start_pos, cache=stage.cache)

    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Single-process oracle: final hidden states ``[n, d_model]`` of the whole sequence."""
        x = self.embed(tokens, 0)
        return self.forward_layers(x, range(self.cfg.n_layers), 0, cache=KVCache())

    def forward_reference(self, tokens: torch.Tensor) -> torch.Tensor:
        """The truth: :meth:`forward_full` in float64 with dense attention, ``[n, d_model]``."""
        model = self.to(torch.float64)
        x = model.embed(tokens, 0)
        return model.forward_layers(x, range(self.cfg.n_layers), 0, attend=_dense_causal)

    def forward_chunked(self, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """Single process, one stage, chunk by chunk (the SPP baseline); same result."""
        stage, outs = ToyStage(0, range(self.cfg.n_layers)), []
        for lo in range(0, tokens.shape[0], chunk_size):
            part = tokens[lo : lo + chunk_size]
            outs.append(self.forward_stage(stage, self.embed(part, lo), lo))
        return torch.cat(outs)


def _dense_causal(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int
) -> torch.Tensor:
    """Causal softmax attention of a whole sequence (``start_pos`` 0), in the inputs' dtype."""
    n, _, d = q.shape
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_tokens(n: int, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    """Deterministic ``[n]`` int64 token ids."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
