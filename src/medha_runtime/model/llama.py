"""The Llama family (Llama 2, 3, 3.1, 3.2) over a paged KV cache.

One :class:`LlamaModel` holds one pipeline stage (``layer_range``) of one TP
rank. TP follows Megatron: q/k/v and gate/up are fused column-parallel
projections holding this rank's heads and MLP columns, o and down are
row-parallel (one all-reduce each), and the token embedding and LM head are
split over the vocabulary (padded to a multiple of the TP degree). Parameter
names keep the global layer index (``layers.5.self_attn.qkv_proj.weight``) so
every stage loads its own slice of a checkpoint; see
:mod:`medha_runtime.model.loader`.

Modules call their children's ``forward`` directly, not through
``nn.Module.__call__`` (no hooks run): a decode step makes about 35 such calls,
each of which would cost more than a one-row op.

Attention goes through :meth:`LlamaModel.set_attention`: the default
:class:`PagedAttention` runs the step's plan (:func:`medha_kernels.plan_paged_attention`);
a KV-parallel worker installs one that attends to its KV shard and merges partial states.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from medha_kernels import rms_norm
from medha_kernels.linear import (
    linear_add_rms_norm_swiglu,
    linear_silu_mul,
    rms_norm_qkv_rotary,
)
from medha_parallel import ColumnParallelLinear, RowParallelLinear, TPCommunicator
from medha_runtime.model.batch import ForwardBatch, KVCache
from medha_runtime.model.config import ModelConfig, resolve_dtype
from medha_runtime.model.rope import RotaryEmbedding, apply_rotary_

Device = torch.device | str


class AttentionFn(Protocol):
    """How a layer attends: ``q`` over the keys the cache holds for each sequence."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        *,
        layer_id: int,
    ) -> torch.Tensor:
        """Args:
            q: ``[num_tokens, num_q_heads_local, head_dim]``, already rotated.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads_local, head_dim]``,
                this chunk's K/V already written at ``batch.slots``.
            batch: the step's index tensors.
            layer_id: the global layer index.

        Returns:
            ``[num_tokens, num_q_heads_local, head_dim]`` in ``q``'s dtype.
        """
        ...


class PagedAttention:
    """The default :class:`AttentionFn`: causal paged attention over the local cache.

    The first layer of a step plans the step's attention
    (:meth:`ForwardBatch.attention_plan`); every layer runs that plan, the later
    ones without its checks (:meth:`ForwardBatch.attention`).

    Args:
        backend: passed to :func:`medha_kernels.plan_paged_attention` (``"auto"``:
            the native C++ kernel on the CPU, else torch; Triton or FlashInfer on GPUs).
    """

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend

    def __repr__(self) -> str:
        return f"PagedAttention(backend={self.backend!r})"

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        *,
        layer_id: int,
    ) -> torch.Tensor:
        return batch.attention(q, k_cache, v_cache, self.backend)[0]


class RMSNorm(nn.Module):
    """RMSNorm as in transformers: normalize in fp32, cast back, then scale.

    Through :func:`medha_kernels.rms_norm`: one native call for fp32 on the CPU
    (bit-identical), else ``F.rms_norm`` (fp32: one composite op, the same
    arithmetic; 16-bit: without a weight, normalizing in fp32 and rounding once
    to the input dtype as transformers' ``h.to(input_dtype)``, then the scale).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        device: Device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → normalized ``[N, hidden_size]`` (the same dtype)."""
        return rms_norm(x, self.weight, self.eps)[1]

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's ``fused_add_rms_norm``: ``h = x + residual`` and its norm, ``(h, norm(h))``;
        ``x``, ``residual`` and both results ``[N, hidden_size]`` in one dtype."""
        return rms_norm(x, self.weight, self.eps, residual)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of the TP degree."""
    return -(-vocab_size // tp) * tp


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over TP ranks (one all-reduce).

    Rank ``r`` holds rows ``[r * V', (r + 1) * V')`` of the embedding padded to
    ``V' * tp`` rows; padding rows are zero.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        comm: TPCommunicator,
        device: Device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.rows_per_rank = padded_vocab(vocab_size, comm.world_size) // comm.world_size
        self.start = comm.rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, device=device, dtype=dtype)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return torch.embedding(self.weight, ids)  # F.embedding's op, without its checks
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class LlamaAttention(nn.Module):
    """Self-attention of one layer with this TP rank's heads."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        comm: TPCommunicator,
        device: Device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = comm.world_size
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.num_q_heads = config.num_q_heads // tp
        self.num_kv_heads = config.num_kv_heads // tp
        self.q_size = self.num_q_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        kw = {"comm": comm, "bias": config.attention_bias, "device": device, "dtype": dtype}
        full_qkv = (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, full_qkv, **kw)
        self.o_proj = RowParallelLinear(
            config.num_q_heads * config.head_dim, config.hidden_size, **kw
        )
        self.attn_fn: AttentionFn = PagedAttention()

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """The hook: ``q [N, Hq_local, D]`` over the cache → ``[N, Hq_local, D]``."""
        return self.attn_fn(q, k_cache, v_cache, batch, layer_id=self.layer_id)

    def write_kv(
        self, qkv: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Write the K/V heads of ``qkv`` (``[N, q_size + 2 kv_size]``, k already rotated)
        through :meth:`ForwardBatch.write_kv`."""
        n, hkv, d = qkv.shape[0], self.num_kv_heads, self.head_dim
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, hkv, d)
        v = qkv[:, self.q_size + self.kv_size :].view(n, hkv, d)
        batch.write_kv(k, v, k_cache, v_cache)

    def attention(
        self,
        x: torch.Tensor,
        cos2: torch.Tensor,
        sin2: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Everything before o_proj: ``[N, hidden_size]`` normed input → ``[N, q_size]``
        (this rank's heads' attention output, flattened); writes the K/V."""
        n, hq, d = x.shape[0], self.num_q_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # [n, q_size + 2 kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(n, hq + self.num_kv_heads, d)
        apply_rotary_(qk, cos2, sin2)  # q's and k's heads at once, in the projection's output
        k = qk[:, hq:]
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, d)
        batch.write_kv(k, v, k_cache, v_cache)
        o = self.attend(qk[:, :hq].contiguous(), k_cache, v_cache, batch)
        return o.reshape(n, self.q_size)

    def forward(
        self,
        x: torch.Tensor,
        cos2: torch.Tensor,
        sin2: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """``[N, hidden_size]`` normed input → ``[N, hidden_size]``: the attention, then o_proj."""
        return self.o_proj.forward(self.attention(x, cos2, sin2, k_cache, v_cache, batch))


class LlamaMLP(nn.Module):
    """SwiGLU with a fused column-parallel gate/up and a row-parallel down."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        comm: TPCommunicator,
        device: Device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"comm": comm, "bias": config.mlp_bias, "device": device, "dtype": dtype}
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, 2 * config.intermediate_size, **kw
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` → ``[N, hidden_size]``: ``down(silu(gate(x)) * up(x))``, the
        activation in one call with the gate/up product (:func:`linear_silu_mul`)."""
        gate_up = self.gate_up_proj
        return self.down_proj.forward(linear_silu_mul(x, gate_up.weight, gate_up.bias))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        comm: TPCommunicator,
        device: Device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(config, layer_id, comm=comm, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(config, comm=comm, **kw)
        # TP 1 and no biases (o_proj's from attention_bias, the MLP's from mlp_bias):
        # from o_proj to the MLP's output in one call (decided once, not per step)
        self._fused_tail = (
            comm.world_size == 1 and not config.attention_bias and not config.mlp_bias
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos2: torch.Tensor,
        sin2: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, its residual adds fused into the norms after them (as vLLM's).

        Args:
            x: ``[N, hidden_size]``: the previous layer's MLP output, or with
                ``residual`` None this layer's input.
            residual: ``[N, hidden_size]``: the previous layer's residual stream
                (its input plus its attention), or None for the first layer.

        Returns:
            ``(mlp output, residual)``, each ``[N, hidden_size]``: this layer's
            output is their sum, ``x + attn(norm(x)) + mlp(norm(...))`` in
            transformers' order of additions.
        """
        residual, o = self._attend(x, residual, cos2, sin2, k_cache, v_cache, batch)
        attn = self.self_attn
        if self._fused_tail:
            # one call where it runs natively (a decode step: fewer calls after the
            # attention, each run cold)
            norm, mlp = self.post_attention_layernorm, self.mlp
            residual, out = linear_add_rms_norm_swiglu(
                o,
                attn.o_proj.weight,
                residual,
                norm.weight,
                norm.eps,
                mlp.gate_up_proj.weight,
                mlp.down_proj.weight,
            )
            return out, residual
        residual, h = self.post_attention_layernorm.forward_add(attn.o_proj.forward(o), residual)
        return self.mlp.forward(h), residual

    def forward_kv_only(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos2: torch.Tensor,
        sin2: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> None:
        """:meth:`forward` up to its attention, for a layer whose output nobody reads: the
        norm, the K/V write and the attention hook (a KVP merge's part), nothing after."""
        self._attend(x, residual, cos2, sin2, k_cache, v_cache, batch)

    def _attend(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos2: torch.Tensor,
        sin2: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention (arguments as :meth:`forward`): the input norm,
        q/k/v, rotary, the K/V write and the attention hook; returns ``(residual, o)``,
        the residual stream and the attention output ``[N, q_size]`` before o_proj."""
        attn = self.self_attn
        front = None
        if self._fused_tail:
            # the same condition (TP 1, no q/k/v bias): from the input norm to the query in
            # one native call, the K/V write in it where the step prepared every row's slot
            norm, index = self.input_layernorm, batch.write_index()
            front = rms_norm_qkv_rotary(
                x,
                residual,
                norm.weight,
                norm.eps,
                attn.qkv_proj.weight,
                attn.num_q_heads,
                attn.num_kv_heads,
                cos2,
                sin2,
                *((k_cache, v_cache, index) if index is not None else ()),
            )
        if front is not None:
            residual, q, qkv = front
            if index is None and batch.writes_kv:  # rows that write nothing (KVP)
                attn.write_kv(qkv, batch, k_cache, v_cache)
            o = attn.attn_fn(q, k_cache, v_cache, batch, layer_id=attn.layer_id)  # attend()
            return residual, o.view(q.shape[0], attn.q_size)
        if residual is None:
            residual, h = x, self.input_layernorm.forward(x)
        else:
            residual, h = self.input_layernorm.forward_add(x, residual)
        return residual, attn.attention(h, cos2, sin2, k_cache, v_cache, batch)


class LlamaModel(nn.Module):
    """One stage of one TP rank of a Llama model.

    Args:
        config: the model's shape.
        dtype: parameter and activation dtype (a torch dtype, a name, or
            ``"auto"`` for ``config.dtype``).
        device: where parameters live (``"meta"`` builds a skeleton for the loader).
        tp: the TP communicator (default: one rank). ``num_kv_heads`` (hence
            ``num_q_heads``) and ``intermediate_size`` must divide by its degree.
        layer_range: this SPP stage's layers (default all). The stage holding
            layer 0 embeds token ids; the one holding the last layer applies the
            final norm and LM head.

    Parameters are initialized for shape only (uniform projections, N(0, 0.02)
    embeddings); real weights come from :func:`medha_runtime.model.loader.load_model`
    or :mod:`medha_runtime.model.tiny`.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: str | torch.dtype,
        device: Device = "cpu",
        tp: TPCommunicator | None = None,
        layer_range: range | None = None,
    ) -> None:
        super().__init__()
        comm = tp if tp is not None else TPCommunicator()
        _check_tp(config, comm.world_size)
        layer_range = range(config.num_layers) if layer_range is None else layer_range
        if (
            layer_range.step != 1
            or len(layer_range) == 0
            or layer_range.start < 0
            or layer_range.stop > config.num_layers
        ):
            raise ValueError(
                f"layer_range {layer_range} must be a non-empty contiguous part of "
                f"range(0, {config.num_layers})"
            )
        self.config = config
        self.dtype = resolve_dtype(dtype, config)
        self.tp = comm
        self.layer_range = layer_range
        self.is_first = layer_range.start == 0
        self.is_last = layer_range.stop == config.num_layers
        self.rotary = RotaryEmbedding(
            config.rope,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
        )
        kw = {"device": device, "dtype": self.dtype}
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, comm=comm, **kw
            )
            with torch.no_grad():
                self.embed_tokens.weight.normal_(0.0, 0.02)
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(config, i, comm=comm, **kw) for i in layer_range}
        )
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
            self.lm_head = ColumnParallelLinear(
                config.hidden_size,
                padded_vocab(config.vocab_size, comm.world_size),
                comm=comm,
                bias=False,
                gather_output=True,
                **kw,
            )
            self.tie_weights()
        self.requires_grad_(False)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head if the config ties them and this stage has both."""
        if self.config.tie_word_embeddings and self.is_first and self.is_last:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def num_kv_heads_local(self) -> int:
        return self.config.num_kv_heads // self.tp.world_size

    def set_attention(self, fn: AttentionFn) -> None:
        """Make every layer attend through ``fn`` (see :class:`AttentionFn`)."""
        for layer in self.layers.values():
            layer.self_attn.attn_fn = fn

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A zeroed cache for this stage's layers and this rank's KV heads."""
        return KVCache.allocate(
            num_layers=len(self.layers),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads_local,
            head_dim=self.config.head_dim,
            dtype=dtype or self.dtype,
            device=self.device,
        )

    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        hidden: torch.Tensor | None = None,
        *,
        logits: bool = True,
        output: bool = True,
    ) -> torch.Tensor | None:
        """Run this stage's layers on a batch; writes the new tokens' K/V into ``kv``.

        Args:
            batch: the step's index tensors, on this model's device.
            kv: this stage's cache (one entry per layer in ``layer_range``).
            hidden: ``[num_tokens, hidden_size]`` from the previous stage;
                required unless this stage is the first.
            logits: False: the last stage also returns its hidden states (for
                :meth:`compute_logits` later; a CUDA graph captures the layers only).
            output: False: nobody reads the result (a KVP group other than the
                sampler's, one stage): the last layer stops after its attention
                (:meth:`LlamaDecoderLayer.forward_kv_only`: its K/V written, its
                attention hook called) and None is returned.

        Returns:
            ``[num_tokens, hidden_size]`` hidden states (in the model dtype) if
            this is not the last stage or ``logits`` is False, else fp32 logits
            ``[len(batch.sample_rows), vocab_size]``.

        Runs without autograd (as under ``torch.no_grad``; a caller already there, as
        ``ModelRunner.execute``, skips the decorator's work).
        """
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._forward(batch, kv, hidden, logits, output)
        return self._forward(batch, kv, hidden, logits, output)

    def _forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        hidden: torch.Tensor | None,
        logits: bool,
        output: bool,
    ) -> torch.Tensor | None:
        if kv.num_layers != len(self.layers):
            raise ValueError(f"kv has {kv.num_layers} layers, this stage {len(self.layers)}")
        if self.is_first:
            x = self.embed_tokens.forward(batch.input_ids)
        elif hidden is None:
            raise ValueError(
                f"stage with layers {self.layer_range} is not the first: pass the previous "
                "stage's hidden states"
            )
        else:
            x = hidden
        # once per step, shared by every layer (see rope.rotary_tables)
        cos2, sin2 = self.rotary.tables(batch.positions, self.dtype)
        residual = None
        last = -1 if output else len(self.layers) - 1
        for i, layer in enumerate(self.layers.values()):
            if i == last:
                layer.forward_kv_only(x, residual, cos2, sin2, kv.k[i], kv.v[i], batch)
                return None
            x, residual = layer.forward(x, residual, cos2, sin2, kv.k[i], kv.v[i], batch)
        if logits and self.is_last and x.shape[0] == 1 and batch.sample_rows.shape[0] == 1:
            # one row, sampled (a batch-1 decode): the final residual add in the norm's
            # call, no gather (the same bits as the add, the row and the norm)
            return self.compute_logits(x, residual)
        x = x + residual
        if not self.is_last or not logits:
            return x
        return self.compute_logits(x[batch.sample_rows])

    def compute_logits(
        self, hidden: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last stage's head: ``[S, hidden_size]`` hidden states (model dtype) of
        the sampled rows → fp32 logits ``[S, vocab_size]`` (final norm, LM head), without
        autograd. ``residual`` (``hidden``'s shape): the hidden states are
        ``hidden + residual``, added in the norm's call."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._logits(hidden, residual)
        return self._logits(hidden, residual)

    def _logits(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        norm = self.norm
        normed = norm.forward(hidden) if residual is None else norm.forward_add(hidden, residual)[1]
        logits = self.lm_head.forward(normed)
        if logits.shape[1] != self.config.vocab_size:  # TP padding rows of the vocabulary
            logits = logits[:, : self.config.vocab_size]
        return logits if logits.dtype == torch.float32 else logits.float()


def _check_tp(config: ModelConfig, tp: int) -> None:
    for name in ("num_kv_heads", "intermediate_size"):
        if getattr(config, name) % tp:
            raise ValueError(
                f"{name}={getattr(config, name)} is not divisible by the TP degree {tp}"
            )
