"""CUDA graphs for decode-only steps of one rank (tp = spp = kvp = 1).

On a GPU a decode step of a small batch is bound by the host: each layer
issues a dozen kernels, and Python spends longer issuing them than the GPU
spends running them. :class:`DecodeGraphs` captures the whole forward pass of
a decode step's layers once per padded batch size and replays them
afterwards: one launch instead of hundreds. The final norm and the LM head run
eagerly on the step's own rows (a few launches; every graph then keeps only
``[b, hidden_size]`` of output, not ``[b, vocab]`` of logits).

A decode step of ``B`` requests runs on the smallest captured size ``b >= B``
(1, 2, 4, 8, then multiples of 8 up to ``max_batch``). Its index tensors are
static buffers that the step fills before the replay; rows ``B..b`` are
padding: token 0 at position 0, one key, written to and read from a scratch
KV block that no request owns (the cache holds one block more than the
scheduler's pool). A graph's attention plan is built once, for a bound on the
keys per row (the step's longest row rounded up to ``KV_BUCKET_MIN`` times a
power of two, at most ``max_model_len``), so its launch grid never changes;
the split-KV decode kernel reads each row's real length from the device and
leaves the splits past it empty. Each padded size keeps one graph per bound it
met: short rows do not pay for the splits of ``max_model_len``-long ones.
Only Triton's attention plan is graph-safe this way (FlashInfer's and the
torch reference's plans read the lengths on the host): another backend leaves
graphs off.

On a CPU (``capture=False``) the same padded static batches run eagerly, with
the plan rebuilt from each step's real lengths: the tests check the padding
and buffers against the plain path there.

Graphs are captured lazily, the first time a (size, bound) is needed. A capture
that fails leaves that (size, bound) eager (one warning each); a backend whose
plan is not graph-safe turns graphs off for the rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from medha_kernels.plan import PagedHost, padded_block_table
from medha_runtime.model import ForwardBatch, KVCache
from medha_runtime.plan import BlockTables, StepPlan

log = logging.getLogger(__name__)

#: the smallest bound on a graph's keys per row (the Triton decode's fewest keys per split)
KV_BUCKET_MIN = 128


def kv_bucket(max_kv: int, max_model_len: int) -> int:
    """The bound a graph's attention plan is built for, for a step whose longest row
    has ``max_kv`` keys: ``KV_BUCKET_MIN`` times the smallest power of two that holds
    it, at most ``max_model_len``."""
    if max_kv < 1 or max_kv > max_model_len:
        raise ValueError(f"max_kv must be in [1, {max_model_len}], got {max_kv}")
    bound = KV_BUCKET_MIN
    while bound < max_kv:
        bound *= 2
    return min(bound, max_model_len)


def graph_sizes(max_batch: int) -> tuple[int, ...]:
    """The padded batch sizes for decodes of up to ``max_batch`` requests: those of
    1, 2, 4, 8, 16, 24, 32, ... (multiples of 8) below ``max_batch``, and the
    smallest one at or above it."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes: list[int] = []
    size = 1
    while True:
        sizes.append(size)
        if size >= max_batch:
            return tuple(sizes)
        size = size * 2 if size < 8 else size + 8


@dataclass
class _Static:
    """One padded size's buffers (all on the model's device) and its graph.

    ``ids`` ``[b]`` int64, ``positions`` ``[b]`` int64, ``kv_lens`` ``[b]`` int32,
    ``slots`` ``[b]`` int64 (every row writes: padding writes the scratch slot),
    ``table`` ``[b, max_blocks]`` int32 (the first ``b`` rows of one buffer every
    size shares); ``hidden`` ``[b, hidden_size]`` (model dtype), the captured
    output: the layers' hidden states, before the final norm and LM head, which
    run eagerly on the step's own rows.
    """

    size: int
    ids: torch.Tensor
    positions: torch.Tensor
    kv_lens: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    cu: torch.Tensor
    rows: torch.Tensor
    #: the last fill's lengths and largest block id (host), for the eager path's plan
    host_lens: list[int] | None = None
    host_max_block: int = 0
    #: per KV bound: (the graph, its output ``hidden``, the static batch it holds)
    graphs: dict[int, tuple[Any, torch.Tensor, ForwardBatch]] = field(default_factory=dict)
    #: KV bounds whose capture failed (run eagerly)
    failed: set[int] = field(default_factory=set)


class DecodeGraphs:
    """Decode steps on padded static batches, replayed from CUDA graphs on a GPU.

    Args:
        model: the rank's whole model (one stage holding every layer).
        kv: its cache, with at least ``scratch_block + 1`` blocks.
        block_size: tokens per KV block.
        max_model_len: the most keys a row can have (sizes the block table and the plan).
        scratch_block: a block no request owns (padding rows write and read it).
        max_batch: the largest decode batch run this way (larger ones run eagerly).
        plan_key: the attention plan's arguments as the layers ask for them
            (``ForwardBatch.attention_plan``).
        capture: capture CUDA graphs (a CUDA model); False runs the padded batches eagerly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        *,
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        max_batch: int,
        plan_key: dict[str, Any],
        capture: bool,
    ) -> None:
        if scratch_block >= kv.num_blocks:
            raise ValueError(
                f"scratch block {scratch_block} is not in a {kv.num_blocks}-block cache"
            )
        self.model, self.kv = model, kv
        self.block_size, self.max_model_len = block_size, max_model_len
        self.scratch_block = scratch_block
        self.sizes = graph_sizes(max_batch)
        self.plan_key = plan_key
        self.capture = capture
        self.device = kv.k[0].device
        self.max_blocks = -(-max_model_len // block_size)
        self._static: dict[int, _Static] = {}
        # one memory pool for every size's graph: their intermediates share memory (the
        # graphs never run at once, and each replay writes its intermediates before it
        # reads them); every graph's output stays allocated, so none is reused
        self._pool: Any = None
        self._tables: torch.Tensor | None = None
        #: why graphs are off for this rank (an attention backend that is not graph-safe)
        self.off: str | None = None
        self.replays = 0

    def fits(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is a decode-only step this object runs: every chunk one
        sampled token with no prompt logprobs, at most the largest size, and graphs
        not turned off."""
        chunks = plan.chunks
        if self.off is not None or not chunks or len(chunks) > self.sizes[-1]:
            return False
        for c in chunks:
            if len(c.token_ids) != 1 or c.sample is None or c.prompt_logprobs is not None:
                return False
            if c.start >= self.max_model_len:
                return False
        return True

    def run(self, plan: StepPlan, tables: BlockTables) -> torch.Tensor | None:
        """The step's logits ``[B, vocab]`` fp32 (B = the plan's chunks, in order): the
        layers replayed on the padded batch, the final norm and LM head run eagerly
        on its first ``B`` rows; or None when this size and KV bound run eagerly (a
        failed capture, or graphs just turned off: the caller runs the step)."""
        size = next(s for s in self.sizes if s >= len(plan.chunks))
        st = self._static.get(size)
        if st is None:
            st = self._static[size] = self._buffers(size)
        self._fill(st, plan, tables)
        n = len(plan.chunks)
        if not self.capture:
            return self.model.compute_logits(self._eager(st)[:n])
        assert st.host_lens is not None
        bound = kv_bucket(max(st.host_lens[:n]), self.max_model_len)
        if bound in st.failed:
            return None
        entry = st.graphs.get(bound) or self._capture(st, bound)
        if entry is None:
            return None
        graph, hidden, _ = entry
        graph.replay()
        self.replays += 1
        return self.model.compute_logits(hidden[:n])

    def _buffers(self, b: int) -> _Static:
        dev = self.device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        return _Static(
            size=b,
            ids=zeros(b, dtype=torch.int64),
            positions=zeros(b, dtype=torch.int64),
            kv_lens=torch.ones(b, dtype=torch.int32, device=dev),
            slots=torch.full((b,), self.scratch_block * self.block_size, device=dev),
            table=self._table()[:b],
            cu=torch.arange(b + 1, dtype=torch.int32, device=dev),
            rows=torch.arange(b, dtype=torch.int64, device=dev),
        )

    def _table(self) -> torch.Tensor:
        """The block-table buffer ``[largest size, max_blocks]`` int32 every size reads
        its first rows of (one buffer: at 1M tokens a row is 256 KiB)."""
        if self._tables is None:
            shape = (self.sizes[-1], self.max_blocks)
            self._tables = torch.full(
                shape, self.scratch_block, dtype=torch.int32, device=self.device
            )
        return self._tables

    def _fill(self, st: _Static, plan: StepPlan, tables: BlockTables) -> None:
        """Copy the step's ids, positions, lengths, slots and block tables into the
        buffers, padding rows ``B..b`` (no host sync: the copies are queued)."""
        b, bs, scratch = st.size, self.block_size, self.scratch_block
        ids: list[int] = []
        positions: list[int] = []
        lens: list[int] = []
        slots: list[int] = []
        rows: list[Sequence[int]] = []
        for c in plan.chunks:
            blocks = tables.blocks(c.request_id, 0)
            p = c.start
            need = p // bs + 1
            if len(blocks) < need:
                raise RuntimeError(
                    f"request {c.request_id!r} has {len(blocks)} blocks, its {p + 1} "
                    f"tokens need {need}"
                )
            ids.append(c.token_ids[0])
            positions.append(p)
            lens.append(p + 1)
            slots.append(blocks[p // bs] * bs + p % bs)
            rows.append(blocks[:need])
        pad = b - len(plan.chunks)
        ids += [0] * pad
        positions += [0] * pad
        lens += [1] * pad
        slots += [scratch * bs] * pad
        rows += [[scratch]] * pad
        table = padded_block_table(rows)
        nb = self.device.type == "cuda"  # queued behind the previous step on the stream
        st.ids.copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=nb)
        st.positions.copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=nb)
        st.kv_lens.copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=nb)
        st.slots.copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=nb)
        st.table[:, : table.shape[1]].copy_(table, non_blocking=nb)
        st.host_lens = lens
        if not self.capture:  # the eager path's plan (block ids >= 0: the zero padding is no max)
            st.host_max_block = int(table.max())

    def _static_batch(self, st: _Static, host: PagedHost) -> ForwardBatch:
        batch = ForwardBatch(
            input_ids=st.ids,
            positions=st.positions,
            cu_seqlens_q=st.cu,
            kv_lens=st.kv_lens,
            block_table=st.table,
            slots=st.slots.to(torch.int32),
            sample_rows=st.rows,
            host=host,
        )
        batch.set_kv_write_index(st.slots)
        return batch

    def _eager(self, st: _Static) -> torch.Tensor:
        """The padded step's hidden states ``[b, hidden_size]`` without a graph: the
        plan from this step's real lengths."""
        b = st.size
        assert st.host_lens is not None
        host = PagedHost(
            cu_seqlens_q=list(range(b + 1)), kv_lens=st.host_lens, max_block=st.host_max_block
        )
        return self.model(self._static_batch(st, host), self.kv, logits=False)

    def _capture(self, st: _Static, bound: int) -> tuple[Any, torch.Tensor, ForwardBatch] | None:
        """Capture size ``st.size``'s layers with an attention plan for ``bound`` keys per
        row. On failure the stream and pool are left as before, this (size, bound) runs
        eagerly from now on (or every size, for a backend whose plan is not
        graph-safe), one warning, and None."""
        b = st.size
        host = PagedHost(
            cu_seqlens_q=list(range(b + 1)),
            kv_lens=[bound] * b,  # the plan's grid: rows of up to ``bound`` keys
            max_block=self.kv.num_blocks - 1,
        )
        batch = self._static_batch(st, host)
        plan = batch.attention_plan(**self.plan_key)
        if plan.backend != "triton":
            self.off = (
                f"the {plan.backend!r} attention plan reads lengths on the host; CUDA graphs "
                "need the 'triton' backend"
            )
            log.warning("CUDA graphs off: %s", self.off)
            return None
        current = torch.cuda.current_stream(self.device)
        try:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles kernels, fills lazy caches outside the capture
                    self.model(batch, self.kv, logits=False)
            current.wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                hidden = self.model(batch, self.kv, logits=False)
        except Exception as exc:  # this (size, bound) runs eagerly from now on
            torch.cuda.set_stream(current)  # a failed capture_end skips the stream's exit
            st.failed.add(bound)
            log.warning(
                "CUDA graph for decodes of %d (rows up to %d keys) not captured, run "
                "eagerly: %s: %s",
                b,
                bound,
                type(exc).__name__,
                exc,
            )
            return None
        st.graphs[bound] = (graph, hidden, batch)
        log.info("captured a CUDA graph for decodes of %d, rows up to %d keys", b, bound)
        return st.graphs[bound]
