"""One rank's execution of :class:`~medha_runtime.plan.StepPlan` s: the model stage, its KV
cache, the KV-parallel attention hook and the sampler.

A rank is one (TP rank, SPP stage, KVP group) of the layout; the same
:class:`ModelRunner` runs in the caller's process (world size 1) or in a
worker process (:mod:`medha_runtime.worker`).

- **TP**: the stage's model is loaded with this rank's shard of every layer
  (``load_model(..., tp=TPCommunicator(state))``); its collectives run inside
  the layers.
- **SPP**: stage ``s`` holds layers :func:`stage_layers` ``(s)`` and the KV of
  those layers only. Stage 0 embeds the batch's tokens; every non-last stage
  sends its hidden states for the whole batch to the next stage, under a
  header naming each request's chunk (:class:`~medha_runtime.stage.PipelineStage`:
  ``medha_parallel``'s ``StageRunner`` with order checks on), without waiting
  for the send. The last stage computes the logits of the sampled rows.
- **KVP**: every KVP group runs every token of the batch through its linear
  layers (they are replicated across KVP groups: only attention is split).
  Group ``g`` builds its own :class:`~medha_runtime.model.ForwardBatch`: RoPE
  positions are absolute, but KV slots, KV lengths and block tables are
  local to the shard ``g`` holds. New tokens' KV is written only where ``g``
  is the chunk's tail group (slot -1 elsewhere). Attention is
  ``medha_parallel``'s: the first layer of a step plans ``g``'s view of the
  batch once (:func:`~medha_parallel.kvp.plan_kvp_attention`: causal on the
  tail, non-causal over a full earlier shard, the empty state ``(0, -inf)``
  where ``g`` holds nothing of a sequence), and in every layer
  :class:`ShardedAttention` runs that plan and merges the partial states
  across the whole KVP group (:func:`~medha_parallel.kvp.kvp_paged_attention`,
  one collective per layer with two groups). Every group takes part in every
  merge, so collectives always line up. With one stage, a group other than the
  sampler's stops its last layer after the attention (nobody reads its output):
  it writes the K/V and only publishes its state to that layer's merge, without
  waiting for the others' (``KVPCommunicator.contributor``; no o-projection, MLP
  or final norm).
- **Sampling** happens on one rank: the last stage's TP rank 0 of KVP group 0
  (every last-stage rank has the same logits); the others return None. With
  async scheduling (``RunnerSpec.pending_tokens``, spp = 1) every rank keeps
  each request's last token for the next batch's ``PENDING_TOKEN`` decodes:
  the sampling rank broadcasts each step's tokens to every rank
  (:class:`~medha_parallel.TokenBroadcast`, one ``int64`` tensor). With
  spp > 1 only stage 0 embeds tokens: the sampling rank sends each batch's
  ids straight to every stage-0 rank (:class:`~medha_parallel.TokenReturn`,
  shared memory), and stage 0 waits for them only before a plan that holds a
  ``PENDING_TOKEN`` decode (:class:`ReturnedTokens`); later stages never read
  the token ids.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch

from medha_kernels import PagedHost
from medha_kernels.plan import host_tensor, padded_block_table
from medha_parallel import (
    KVPCommunicator,
    ParallelState,
    TokenBroadcast,
    TokenReturn,
    TPCommunicator,
)
from medha_parallel.kvp import (
    KVPAttentionPlan,
    KVPPart,
    plan_kvp_attention,
)
from medha_parallel.tokens import return_slots
from medha_runtime.cpu_memory import keep_freed_memory
from medha_runtime.decode_graphs import DecodeGraphs
from medha_runtime.model import ForwardBatch, KVCache, PagedAttention, load_model
from medha_runtime.plan import BlockTables, PlannedChunk, StepPlan
from medha_runtime.sampling import Sampled, Sampler, logit_rows, sample_step
from medha_runtime.stage import PipelineStage
from medha_sched.output import PENDING_TOKEN


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a rank needs to build its stage (plain data, sent to workers).

    Attributes:
        model: a model name or path (the engine passes the resolved path, see
            :func:`~medha_runtime.model.names.resolve_model`).
        dtype: dtype name (``"auto"`` allowed).
        device: ``"cpu"``, ``"cuda"`` (each rank takes ``cuda:<local rank>``) or None (auto).
        tp, spp, kvp: the layout.
        num_blocks: KV blocks in each KVP group's pool.
        block_size: tokens per block.
        group_tokens: tokens of one request one KVP group holds (``G``).
        attention_backend: the ``medha_kernels`` backend (``"auto"``).
        kvp_merge: the KVP merge strategy (``"auto"``, ``"ag_lse_ar"`` or ``"ag_all"``,
            see :meth:`medha_parallel.KVPCommunicator.merge`).
        timeout_s: bound on every collective (worker processes).
        num_threads: torch CPU threads per worker process (None: cores / ranks).
        pending_tokens: keep each request's last sampled token, for decodes
            issued ahead (token id ``PENDING_TOKEN``; async scheduling). With
            several ranks and spp = 1 the sampling rank broadcasts each step's
            sampled tokens to every rank (:class:`medha_parallel.TokenBroadcast`);
            with spp > 1 it sends them to the stage-0 ranks only
            (:class:`medha_parallel.TokenReturn`: every rank on this host).
        cuda_graph_max_batch: run decode-only steps of up to this many requests
            on padded static batches (CUDA graphs on a GPU, see
            :mod:`medha_runtime.decode_graphs`); 0: off. One rank only.
        max_model_len: the most tokens a request holds (sizes the graphs' block
            tables and attention plans; needed with ``cuda_graph_max_batch``).
    """

    model: str
    dtype: str = "auto"
    device: str | None = None
    tp: int = 1
    spp: int = 1
    kvp: int = 1
    num_blocks: int = 1024
    block_size: int = 16
    group_tokens: int = 16384
    attention_backend: str = "auto"
    kvp_merge: str = "auto"
    timeout_s: float = 60.0
    num_threads: int | None = None
    pending_tokens: bool = False
    cuda_graph_max_batch: int = 0
    max_model_len: int = 0

    def __post_init__(self) -> None:
        if self.cuda_graph_max_batch and (self.world_size != 1 or self.max_model_len < 1):
            raise ValueError(
                f"cuda_graph_max_batch={self.cuda_graph_max_batch} needs one rank and "
                f"max_model_len >= 1, got {self.world_size} ranks, "
                f"max_model_len={self.max_model_len}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.spp * self.kvp


def stage_layers(num_layers: int, spp: int, stage: int) -> range:
    """The layers of pipeline stage ``stage`` of ``spp``: contiguous, earlier stages one more."""
    if not 1 <= spp <= num_layers:
        raise ValueError(f"spp={spp} must be between 1 and the model's {num_layers} layers")
    per, extra = divmod(num_layers, spp)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (1 if stage < extra else 0))


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class GroupShards(NamedTuple):
    """What one KVP group holds of each sequence of a step (host lists, in batch order).

    Attributes:
        num_q: query rows per sequence.
        kv_lens: keys the group holds per sequence (its chunk's own on the tail; 0: none).
        is_tail: whether the group holds the sequence's newest keys.
        block_tables: the group's blocks per sequence.
    """

    num_q: list[int]
    kv_lens: list[int]
    is_tail: list[bool]
    block_tables: list[Sequence[int]]


class ShardedAttention:
    """The KVP attention hook: :func:`medha_parallel.kvp.kvp_paged_attention` per layer.

    :meth:`prepare` takes the step's :class:`GroupShards` (built by
    :func:`build_group_batch`) before the forward pass; the first layer plans
    the step (:func:`medha_parallel.kvp.plan_kvp_attention`, or the batch's own
    causal plan where that is the same single call: decodes and tail chunks
    only) and every layer runs that plan and merges over the KVP group.
    """

    def __init__(
        self, comm: KVPCommunicator, *, backend: str = "auto", strategy: str = "auto"
    ) -> None:
        self.comm = comm
        self.backend = backend
        self.strategy = strategy
        self.shards: GroupShards | None = None
        self.plan: KVPAttentionPlan | None = None
        #: the plan's partial state per layer: its one paged-attention call's ``run``
        #: where that covers every row (a decode step), else ``plan.partial``
        self._partial: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        #: the step's merge for its later layers: the communicator's resolved one
        #: (``KVPCommunicator.merger``) where the first layer's merge found it, else None
        self._merge: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        #: the layer whose merged output the step does not read (:meth:`prepare`), or None
        self._drop_layer: int | None = None

    def __repr__(self) -> str:
        return f"ShardedAttention({self.comm}, backend={self.backend!r})"

    def prepare(self, shards: GroupShards, *, drop_layer: int | None = None) -> None:
        """The step's shards; ``drop_layer``: a layer whose merged output nobody reads
        (the stage's last, on a KVP group that does not sample): that layer only hands
        its partial state to the others' merge where it can without waiting for theirs
        (``KVPCommunicator.contributor``) and returns its partial output."""
        self.shards, self.plan, self._partial, self._merge = shards, None, None, None
        self._drop_layer = drop_layer

    def _batch_plan(
        self, q: torch.Tensor, k_cache: torch.Tensor, batch: ForwardBatch
    ) -> KVPAttentionPlan | None:
        """The step's plan from the batch's own causal plan, where every sequence is one
        causal call on this group (it holds keys of each, and each is on its tail or a
        decode): :func:`plan_kvp_attention` would plan that same call from the same
        lists, only slower (a decode step: ~30 us against ~60 us). None otherwise."""
        shards = self.shards
        assert shards is not None
        if not _one_causal_call(shards):
            return None
        plan = batch.attention_plan_for(q, k_cache, self.backend)
        return KVPAttentionPlan(num_q=int(q.shape[0]), parts=(KVPPart(None, plan),))

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        *,
        layer_id: int,
    ) -> torch.Tensor:
        partial = self._partial
        if partial is None:  # the step's first layer plans, and checks the rows once
            if self.shards is None:
                raise RuntimeError("ShardedAttention.prepare was not called for this step")
            self.plan = self._batch_plan(q, k_cache, batch) or plan_kvp_attention(
                **self.shards._asdict(),
                num_qo_heads=q.shape[1],
                num_kv_heads=k_cache.shape[2],
                head_dim=q.shape[2],
                block_size=k_cache.shape[1],
                dtype=q.dtype,
                device=q.device,
                backend=self.backend,
            )
            out, lse = self.plan.partial(q, k_cache, v_cache)
            self._partial = self.plan.partial_fn()
        else:  # later layers: the partial state and the merge with fewest frames (each
            # runs cold after the previous layer's attention streamed its KV shard through
            # the caches); every layer's states have the first one's shapes
            out, lse = partial(q, k_cache, v_cache)
            merge = self._merge
            if merge is not None and layer_id != self._drop_layer:
                return merge(out, lse)[0]
        comm, strategy = self.comm, self.strategy
        if layer_id == self._drop_layer:
            contribute = comm.contributor(out, lse, active=comm.size, strategy=strategy)  # type: ignore[arg-type]
            if contribute is not None:
                contribute(out, lse)
                return out  # not read
        # what kvp_paged_attention does: one merge over the whole KVP group
        merged, _ = comm.merge(out, lse, active=comm.size, strategy=strategy)  # type: ignore[arg-type]
        if partial is None:
            self._merge = comm.merger(out, lse, active=comm.size, strategy=strategy)  # type: ignore[arg-type]
        return merged


def _one_causal_call(shards: GroupShards) -> bool:
    """Whether a step's attention on this group is the batch's own causal plan
    (:meth:`ShardedAttention._batch_plan`): it holds keys of every sequence, each
    on its tail or a decode."""
    return all(
        kv > 0 and (tail or n == 1)
        for n, kv, tail in zip(shards.num_q, shards.kv_lens, shards.is_tail, strict=True)
    )


#: the most builds :meth:`ModelRunner.prepare_next` skips after misses in a row
_AHEAD_MAX_SKIP = 16


def build_group_batch(
    plan: StepPlan,
    tables: BlockTables,
    *,
    group: int,
    kvp: int,
    group_tokens: int,
    block_size: int,
    device: torch.device | str,
    capacity: int | None = None,
) -> tuple[ForwardBatch, GroupShards]:
    """KVP group ``group``'s view of a step: its :class:`ForwardBatch` and :class:`GroupShards`.

    Positions are absolute; slots, KV lengths and block tables are local to
    the group's shard of each sequence (see the module docstring).

    ``capacity``: the slots of each layer's cache (``num_blocks * block_size``).
    Given, a batch whose every row writes its K/V here gets its int64 write
    index from the host list (:meth:`ForwardBatch.set_kv_write_index`, checked
    against ``capacity`` on the host): what :meth:`ForwardBatch.prepare_kv_write`
    would keep, without its tensor reductions and host reads.
    """
    g_tokens = group_tokens
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    shards = GroupShards([], [], [], [])
    sample_rows: list[int] = []
    for c in plan.chunks:
        n = len(c.token_ids)
        if n == 0:
            raise ValueError(f"request {c.request_id!r}: empty chunk at position {c.start}")
        tail = len(c.kvp_groups) - 1
        if kvp > 1 and (c.start // g_tokens != tail or (c.start + n - 1) // g_tokens != tail):
            raise ValueError(
                f"request {c.request_id!r}: chunk [{c.start}, {c.start + n}) is not inside "
                f"shard {tail} of {g_tokens} tokens (groups {c.kvp_groups})"
            )
        ids.extend(c.token_ids)
        positions.extend(range(c.start, c.start + n))
        blocks: Sequence[int] = ()
        kv, is_tail, local = 0, False, 0
        if group in c.kvp_groups:
            shard = c.kvp_groups.index(group)
            blocks = tables.blocks(c.request_id, group)
            is_tail = shard == tail
            if is_tail:
                local = c.start - shard * g_tokens
                kv = local + n
            else:
                kv = g_tokens
        need = -(-kv // block_size)
        if len(blocks) < need:
            raise RuntimeError(
                f"request {c.request_id!r} has {len(blocks)} blocks on KVP group {group}, "
                f"its {kv} tokens there need {need}"
            )
        if is_tail:
            slots.extend(
                blocks[p // block_size] * block_size + p % block_size
                for p in range(local, local + n)
            )
        else:
            slots.extend([-1] * n)
        shards.num_q.append(n)
        shards.kv_lens.append(kv)
        shards.is_tail.append(is_tail)
        shards.block_tables.append(blocks[:need])
        cu.append(len(ids))
        sample_rows.extend(logit_rows(c, len(ids) - n))

    table = padded_block_table(shards.block_tables)
    max_block = int(table.max()) if table.numel() else -1  # padding zeros: ids are >= 0
    batch = ForwardBatch(
        input_ids=host_tensor(ids, torch.int64, device),
        positions=host_tensor(positions, torch.int64, device),
        cu_seqlens_q=host_tensor(cu, torch.int32, device),
        kv_lens=host_tensor(shards.kv_lens, torch.int32, device),
        block_table=table.to(device),
        slots=host_tensor(slots, torch.int32, device),
        sample_rows=host_tensor(sample_rows, torch.int64, device),
        host=PagedHost(cu_seqlens_q=cu, kv_lens=shards.kv_lens, max_block=max_block),
        writes_kv=any(shards.is_tail),  # a chunk's KV is written on its tail group only
    )
    if capacity is not None and all(shards.is_tail):  # every row writes: slots all >= 0
        if slots and (top := max(slots)) >= capacity:
            raise ValueError(f"slots: {top} is past the cache's {capacity} slots")
        batch.set_kv_write_index(host_tensor(slots, torch.int64, device))
    return batch, shards


def allocate_kv(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCache:
    """A zeroed paged cache.

    Real steps write every slot before reading it, but synthetic (profiling)
    steps read slots nobody wrote: zeros keep them free of NaNs and denormals,
    which would distort the timings. On the CPU, on huge pages where the kernel
    allows (:meth:`KVCache.allocate`).
    """
    return KVCache.allocate(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
    )


class ModelRunner:
    """One rank: its model stage, KV cache, block tables, and (on one rank) the sampler.

    Args:
        spec: what to build.
        state: this rank's parallel state (None for a single process).
    """

    def __init__(self, spec: RunnerSpec, state: ParallelState | None = None) -> None:
        self.spec = spec
        if state is None:
            if spec.world_size != 1:
                raise ValueError(f"a layout of {spec.world_size} ranks needs a ParallelState")
            tp, stage, group = 0, 0, 0
            self.device = torch.device(resolve_device(spec.device))
        else:
            tp, stage, group = state.coords.tp, state.coords.spp, state.coords.kvp
            self.device = state.device
        # with several ranks: the sampling rank's tokens to every rank, after
        # each step. Built first (collective): a rank that fails later in its
        # start-up (a missing model file) leaves no peer waiting in new_group.
        tokens = back = None
        if spec.pending_tokens and state is not None and spec.world_size > 1:
            src = state.layout.rank(tp=0, spp=spec.spp - 1, kvp=0)
            if spec.spp == 1:
                tokens = TokenBroadcast(state, src=src)
            else:  # stage 0 alone embeds tokens: the ids go back there only
                layout = state.layout
                dst = [
                    layout.rank(tp=t, spp=0, kvp=g) for g in range(spec.kvp) for t in range(spec.tp)
                ]
                back = TokenReturn(state, src=src, dst=dst, slots=return_slots(spec.spp))
        if self.device.type == "cpu":
            keep_freed_memory()  # no page faults for each step's activations
        self.group, self.stage = group, stage
        from medha_runtime.model import load_config

        config = load_config(spec.model)
        layers = stage_layers(config.num_layers, spec.spp, stage)
        comm = TPCommunicator(state) if state is not None else None
        self.model, self.config = load_model(
            spec.model, dtype=spec.dtype, device=self.device, tp=comm, layer_range=layers
        )
        self.model.eval()
        graphs = spec.cuda_graph_max_batch > 0
        self.kv = allocate_kv(
            num_layers=len(layers),
            num_blocks=spec.num_blocks + graphs,  # the graphs' padding rows: a scratch block
            block_size=spec.block_size,
            num_kv_heads=self.model.num_kv_heads_local,
            head_dim=self.config.head_dim,
            dtype=self.model.dtype,
            device=self.device,
        )
        self.attention: ShardedAttention | None = None
        if spec.kvp > 1:
            assert state is not None
            self.attention = ShardedAttention(
                KVPCommunicator(state), backend=spec.attention_backend, strategy=spec.kvp_merge
            )
            self.model.set_attention(self.attention)
        elif spec.attention_backend != "auto":
            self.model.set_attention(PagedAttention(spec.attention_backend))
        self.pipeline: PipelineStage | None = None
        if spec.spp > 1:
            assert state is not None
            self.pipeline = PipelineStage(
                state,
                self.model,
                self.kv,
                hidden_size=self.config.hidden_size,
                max_inflight=max(2, spec.spp),
            )
        attn = next(iter(self.model.layers.values())).self_attn
        #: the attention plan's key as the layers ask for it (ForwardBatch.attention_plan_for)
        self._plan_key = {
            "num_qo_heads": attn.num_q_heads,
            "num_kv_heads": self.model.num_kv_heads_local,
            "head_dim": attn.head_dim,
            "block_size": spec.block_size,
            "dtype": self.model.dtype,
            "backend": getattr(attn.attn_fn, "backend", "auto"),
        }
        #: slots of each layer's cache (the KV write index is checked against it)
        self._kv_slots = self.kv.k[0].shape[0] * spec.block_size
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv,
                block_size=spec.block_size,
                max_model_len=spec.max_model_len,
                scratch_block=spec.num_blocks,
                max_batch=spec.cuda_graph_max_batch,
                plan_key=self._plan_key,
                capture=self.device.type == "cuda",
            )
        is_sampler = stage == spec.spp - 1 and tp == 0 and group == 0
        #: one stage, a KVP group that does not sample: nothing reads the model's output,
        #: so the last layer stops after its attention, whose merge it only feeds
        #: (LlamaModel.forward's ``output``, ShardedAttention.prepare's ``drop_layer``)
        self._drop_layer = layers.stop - 1 if spec.kvp > 1 and spec.spp == 1 and group else None
        self.sampler: Sampler | None = Sampler() if is_sampler else None
        self.tables = BlockTables()
        #: each request's last sampled token, for a decode issued ahead (its
        #: token id is ``PENDING_TOKEN``: the previous batch samples it)
        self._last_token: dict[str, int] | None = None
        #: with several ranks: the sampling rank's tokens to every rank, after each step
        self._tokens: TokenBroadcast | None = tokens
        #: spp > 1: the sampling rank's channel to stage 0 (None on the other stages)
        self._send_back: TokenReturn | None = back if back is not None and back.is_sender else None
        #: spp > 1, stage 0: the ids the last stage sent back, batch by batch
        self.returned: ReturnedTokens | None = None
        if spec.pending_tokens and (spec.spp == 1 or stage == 0):
            self._last_token = {}
            if back is not None:
                self.returned = ReturnedTokens(back, self._last_token)
        #: wall and thread CPU seconds the last step waited for the last stage's tokens
        #: (stage 0, spp > 1; the wait spins, yielding its core, before it sleeps)
        self.token_wait_s = self.token_wait_cpu_s = 0.0
        #: the last step run eagerly, every chunk of it sampled: :meth:`prepare_next`
        #: builds the batch of its requests' next decodes from it (None: nothing to build)
        self._last_plan: StepPlan | None = None
        #: what :meth:`prepare_next` built: the chunks it assumed, their batch and shards
        self._ahead: tuple[tuple[PlannedChunk, ...], ForwardBatch, GroupShards] | None = None
        #: steps that ran the batch :meth:`prepare_next` built (the others built their own)
        self.steps_ahead = 0
        #: batches :meth:`prepare_next` built that the next step did not use, in a row,
        #: and the builds it still skips for them (its back-off, :meth:`_missed_ahead`)
        self._ahead_misses = self._ahead_skip = 0

    @property
    def is_sampler(self) -> bool:
        return self.sampler is not None

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> list[Sampled] | None:
        """Run one step; the sampling rank returns one :class:`Sampled` per sampled row."""
        self.tables.drop(plan.free)
        self.tables.drop(plan.finished)
        if self.pipeline is not None:
            self.pipeline.forget(plan.free)
            self.pipeline.forget(plan.finished)
        if self.sampler is not None:
            self.sampler.forget(plan.finished)
        last, returned = self._last_token, self.returned
        fill = None
        if returned is not None:  # stage 0, spp > 1: what the last stage sent back so far
            returned.drop((*plan.free, *plan.finished))
            returned.take(block=False)
            self.token_wait_s = self.token_wait_cpu_s = 0.0
            pending = _pending_rows(plan)
            if pending:  # the batch is built first, then its tokens awaited (_fill_returned)
                fill = partial(self._fill_returned, pending)
        elif last is not None:
            for rid in (*plan.free, *plan.finished):
                last.pop(rid, None)
            plan = self._fill_pending(plan, last)
        for c in plan.chunks:
            if c.new_blocks:
                self.tables.extend(c.request_id, c.new_blocks)
        self._last_plan = None
        try:
            result = self._run(plan, fill)
            if returned is not None:
                returned.ran(plan)
            elif self._send_back is not None:
                self._send_tokens(plan, result)
            elif last is not None:
                self._keep_tokens(plan, result, last)
            if not plan.release_after and self._can_prepare() and plan.chunks:
                self._last_plan = plan
            return result
        finally:
            if plan.release_after:
                if returned is not None:
                    returned.drop(plan.release_after)
                elif last is not None:
                    for rid in plan.release_after:
                        last.pop(rid, None)
                self.tables.drop(plan.release_after)
                if self.pipeline is not None:
                    self.pipeline.forget(plan.release_after)
                if self.sampler is not None:
                    self.sampler.forget(plan.release_after)

    def _can_prepare(self) -> bool:
        """Whether :meth:`prepare_next` may build batches here: one stage, eager, on the CPU."""
        return self.pipeline is None and self.graphs is None and self.device.type == "cpu"

    def prepare_next(self, stop: Callable[[], bool] | None = None) -> bool:
        """Build, ahead, the batch of the step that would follow the last one if it gave
        each of its requests its next decode and nothing else (what a decode step of an
        unchanged batch is): a worker does this while it waits for the driver's next
        step, which then skips the batch build, the KV write index and the attention
        plan (~0.1 ms of host work a decode step) if it is that step.

        The next step uses the batch only if it holds those decodes, in that order, with
        the same sampling, frees and finishes nothing and brings no new blocks for this
        rank's group (:meth:`_take_ahead`): then its own build would give the same
        tensors but for the token ids, which it writes. Built once per step; a step
        that is not that one builds its own batch, as without this.

        Limitation: a build needs every request whose tail is on this rank's group to
        have its next slot in a block it already holds. With ``B`` such decodes at
        staggered positions, each opens a block on one step in ``block_size``, so a
        build happens on only about ``(1 - 1/block_size) ** B`` of the steps (block
        16: 52% at B = 10, 13% at B = 32): this helps small batches most.

        Back-off: after two builds in a row that the next step did not use, the next
        2, then 4, 8 and at most 16 builds are skipped (each further miss doubles it);
        a used build ends it (:meth:`_missed_ahead`).

        Args:
            stop: asked once the batch and its KV write index are built: True (a step
                waits) leaves the attention plan to the step's first layer, which
                builds the same one.

        Returns:
            Whether a batch was built: not where the last step's last chunk (where
            the engine puts prefill chunks, so a step with one ends here at once) or
            any other chunk samples nothing (a prefill chunk) or wants prompt
            logprobs, a request's next position leaves its tail shard or needs a
            block this rank does not have yet, or the back-off skips this build.
        """
        last, self._last_plan, self._ahead = self._last_plan, None, None
        if last is None:
            return False
        final = last.chunks[-1]
        if final.sample is None or final.prompt_logprobs is not None:
            return False
        spec = self.spec
        g_tokens, block = spec.group_tokens, spec.block_size
        chunks = []
        for c in last.chunks:
            if c.sample is None or c.prompt_logprobs is not None:
                return False
            start = c.start + len(c.token_ids)
            tail = len(c.kvp_groups) - 1
            if spec.kvp > 1 and start // g_tokens != tail:
                return False  # the next decode opens a new shard
            if c.kvp_groups[tail] == self.group:  # it writes here: its slot's block is known
                local = start - tail * g_tokens if spec.kvp > 1 else start
                if local // block >= len(self.tables.blocks(c.request_id, self.group)):
                    return False
            chunks.append(PlannedChunk(c.request_id, start, (0,), c.kvp_groups, (), c.sample))
        if self._ahead_skip:
            self._ahead_skip -= 1
            return False
        plan = StepPlan(last.step_id, tuple(chunks))
        batch, shards = build_group_batch(
            plan,
            self.tables,
            group=self.group,
            kvp=spec.kvp,
            group_tokens=g_tokens,
            block_size=block,
            device=self.device,
            capacity=self._kv_slots,
        )
        batch.prepare_kv_write(self.kv.k[0])
        if (self.attention is None or _one_causal_call(shards)) and (stop is None or not stop()):
            # the plan the first layer asks for (ShardedAttention._batch_plan: the same key)
            batch.attention_plan(**self._plan_key)
        self._ahead = (plan.chunks, batch, shards)
        return True

    def _missed_ahead(self) -> None:
        """The next step did not use the batch :meth:`prepare_next` built: from the
        second such step in a row, skip the next ``min(2 ** (misses - 1), 16)`` builds."""
        self._ahead_misses += 1
        if self._ahead_misses >= 2:
            self._ahead_skip = min(1 << (self._ahead_misses - 1), _AHEAD_MAX_SKIP)

    def _take_ahead(self, plan: StepPlan) -> tuple[ForwardBatch, GroupShards] | None:
        """The batch :meth:`prepare_next` built, with ``plan``'s token ids, if ``plan``
        is the step it assumed; else None (and it is dropped, a miss for the back-off)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        assumed, batch, shards = ahead
        if plan.free or plan.finished or len(plan.chunks) != len(assumed):
            self._missed_ahead()
            return None
        group = self.group
        for c, a in zip(plan.chunks, assumed, strict=True):
            if (
                c.request_id != a.request_id
                or c.start != a.start
                or len(c.token_ids) != 1
                or c.kvp_groups != a.kvp_groups
                or c.sample != a.sample
                or c.prompt_logprobs is not None
                or any(g == group for g, _ in c.new_blocks)
            ):
                self._missed_ahead()
                return None
        batch.input_ids = host_tensor([c.token_ids[0] for c in plan.chunks], torch.int64)
        self.steps_ahead += 1
        self._ahead_misses = 0
        return batch, shards

    def _keep_tokens(
        self, plan: StepPlan, result: list[Sampled] | None, last: dict[str, int]
    ) -> None:
        """Keep each sampled row's token for its request's next decode issued ahead;
        with several ranks every rank gets the sampling rank's tokens (one broadcast)."""
        rows = [c.request_id for c in plan.chunks if c.sample is not None]
        # the sampling rank's ids (prompt logprobs follow the sampled rows)
        ids = None if result is None else [s.token_id for s in result[: len(rows)]]  # type: ignore[union-attr]
        if self._tokens is not None:
            ids = self._tokens.broadcast(ids, len(rows))
        elif not result:
            return
        assert ids is not None
        for rid, token in zip(rows, ids, strict=True):
            last[rid] = token

    def _send_tokens(self, plan: StepPlan, result: list[Sampled] | None) -> None:
        """spp > 1, the sampling rank: the sampled rows' ids to stage 0 (one message
        per batch that samples; prompt logprobs follow the sampled rows)."""
        rows = sum(1 for c in plan.chunks if c.sample is not None)
        if rows:
            assert result is not None and self._send_back is not None
            self._send_back.send([s.token_id for s in result[:rows]])  # type: ignore[union-attr]

    @staticmethod
    def _fill_pending(plan: StepPlan, last: dict[str, int]) -> StepPlan:
        """``plan`` with every ``PENDING_TOKEN`` decode given its request's last
        sampled token (batches run in order, so the previous one sampled it)."""
        chunks = plan.chunks
        pending = [
            i for i, c in enumerate(chunks) if c.token_ids and c.token_ids[0] == PENDING_TOKEN
        ]
        if not pending:
            return plan
        chunks = list(chunks)
        for i in pending:
            c = chunks[i]
            token = last.get(c.request_id)
            if token is None or len(c.token_ids) != 1:
                raise RuntimeError(
                    f"request {c.request_id!r}: a decode issued ahead at position {c.start} "
                    "but no token was sampled for it before"
                )
            chunks[i] = c._replace(token_ids=(token,))
        return replace(plan, chunks=tuple(chunks))

    def _fill_returned(self, pending: list[tuple[int, str]], batch: ForwardBatch) -> None:
        """Stage 0, spp > 1: wait for the ids of every batch before this one (the last
        stage sends them), then put the ``PENDING_TOKEN`` decodes' tokens at their
        ``(row, request id)`` in the built batch's ``input_ids`` (``[N]`` int64, the
        step's tokens in order)."""
        returned, last = self.returned, self._last_token
        assert returned is not None and last is not None
        c0 = time.thread_time()
        self.token_wait_s = returned.take(block=True)
        self.token_wait_cpu_s = time.thread_time() - c0
        tokens = []
        for _, rid in pending:
            token = last.get(rid)
            if token is None:
                raise RuntimeError(
                    f"request {rid!r}: a decode issued ahead but no token was sampled for it before"
                )
            tokens.append(token)
        ids = batch.input_ids
        if len(pending) == 1:
            ids[pending[0][0]] = tokens[0]
        else:
            rows = torch.tensor([r for r, _ in pending], dtype=torch.int64, device=ids.device)
            ids[rows] = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)

    def _run(
        self, plan: StepPlan, fill: Callable[[ForwardBatch], None] | None = None
    ) -> list[Sampled] | None:
        """Run the plan; ``fill`` (stage 0, spp > 1) completes the built batch's
        token ids just before its forward pass."""
        spec = self.spec
        if self.graphs is not None and self.sampler is not None and self.graphs.fits(plan):
            logits = self.graphs.run(plan, self.tables)
            if logits is not None:  # None: graphs just turned off, run it eagerly
                return sample_step(self.sampler, logits, plan.chunks)  # type: ignore[return-value]
        ahead = self._take_ahead(plan) if self._ahead is not None else None
        if ahead is not None:  # built by prepare_next while this rank waited for the step
            batch, shards = ahead
        else:
            batch, shards = build_group_batch(
                plan,
                self.tables,
                group=self.group,
                kvp=spec.kvp,
                group_tokens=spec.group_tokens,
                block_size=spec.block_size,
                device=self.device,
                capacity=self._kv_slots,
            )
            # the step's fixed host work before the forward pass: a later stage does it
            # while it waits for the previous stage's activations
            batch.prepare_kv_write(self.kv.k[0])
        if self.attention is not None:
            self.attention.prepare(shards, drop_layer=self._drop_layer)
        else:
            batch.attention_plan(**self._plan_key)
        if fill is not None:
            fill(batch)
        if self.pipeline is None:
            # logits only where they are sampled: a KVP group other than 0 would compute
            # them and drop them (with TP, every TP rank takes part in the LM head's gather)
            out = self.model.forward(  # (no module hooks: nn.Module.__call__'s checks skipped)
                batch,
                self.kv,
                logits=self.sampler is not None or spec.tp > 1,
                output=self._drop_layer is None,
            )
        else:
            out = self.pipeline.run(plan, batch)  # non-last stages: sent on, not awaited
            if not self.pipeline.is_last:
                return None
        if self.sampler is None:
            return None
        return sample_step(self.sampler, out, plan.chunks)  # type: ignore[return-value]


def _pending_rows(plan: StepPlan) -> list[tuple[int, str]]:
    """``(row in the batch, request id)`` of each decode of ``plan`` whose token id is
    ``PENDING_TOKEN``."""
    rows, at = [], 0
    for c in plan.chunks:
        ids = c.token_ids
        if ids and ids[0] == PENDING_TOKEN:
            if len(ids) != 1:
                raise RuntimeError(f"request {c.request_id!r}: a pending chunk of {len(ids)} ids")
            rows.append((at, c.request_id))
        at += len(ids)
    return rows


class ReturnedTokens:
    """Stage 0 with spp > 1 and async scheduling: the ids the last stage's sampling
    rank sends back (:class:`~medha_parallel.TokenReturn`), one message per
    batch that samples, in batch order, into each request's last token.

    Before each plan: :meth:`drop` the requests it frees, then :meth:`take`
    what arrived without blocking; a plan holding a ``PENDING_TOKEN`` decode
    builds its batch and then blocks in :meth:`take` for every earlier
    batch's ids (so prefill chunks keep pipelining, and the wait overlaps the
    batch build); after it ran, :meth:`ran` notes its sampled rows. Ids that
    arrive for a request dropped after their batch (finished, preempted,
    released) are not kept.

    Args:
        channel: this rank's receiving end.
        last: request id -> its last sampled token (updated in place).
    """

    def __init__(self, channel: TokenReturn, last: dict[str, int]) -> None:
        self.channel, self.last = channel, last
        #: (plan number, its sampled rows' request ids) whose ids are not read yet
        self.waiting: deque[tuple[int, list[str]]] = deque()
        #: request id -> the number of the first plan run after it was dropped
        self.gone: dict[str, int] = {}
        self.plans = 0  # plans run so far (the next one's number)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Requests whose state is gone before the next plan runs."""
        for rid in request_ids:
            self.last.pop(rid, None)
            if self.waiting:  # ids of earlier batches for it may still come
                self.gone[rid] = self.plans

    def take(self, *, block: bool) -> float:
        """Read the ids that arrived (``block``: every batch's so far); returns the
        wall seconds spent waiting."""
        waiting, channel, last, gone = self.waiting, self.channel, self.last, self.gone
        t0 = time.perf_counter()
        while waiting and (block or channel.arrived()):
            number, rows = waiting.popleft()
            ids = channel.recv(len(rows))
            for rid, token in zip(rows, ids, strict=True):
                if gone.get(rid, -1) <= number:
                    last[rid] = token
        if gone:  # a drop matters only to the ids of batches run before it
            first = waiting[0][0] if waiting else self.plans
            for rid in [r for r, n in gone.items() if n <= first]:
                del gone[rid]
        return time.perf_counter() - t0 if block else 0.0

    def ran(self, plan: StepPlan) -> None:
        """The plan ran on this stage: its sampled rows' ids come back later."""
        rows = [c.request_id for c in plan.chunks if c.sample is not None]
        if rows:
            self.waiting.append((self.plans, rows))
        self.plans += 1


def kv_bytes_per_token(
    *, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int, tp: int, spp: int
) -> int:
    """KV bytes one token takes on one rank (its stage's layers, its KV heads)."""
    layers = math.ceil(num_layers / spp)
    return 2 * layers * (num_kv_heads // tp) * head_dim * itemsize
