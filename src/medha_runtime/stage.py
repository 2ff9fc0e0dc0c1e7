"""One rank's stage of the stream pipeline (SPP > 1), on ``medha_parallel``'s primitives.

Every step's batch crosses the stages as one
:class:`~medha_parallel.MicroBatch` with real headers: one
:class:`~medha_parallel.ChunkMeta` per request, carrying the request's
sequence id (:func:`seq_id`), the chunk's index among that request's chunks,
its absolute start position and its token count. A
:class:`~medha_parallel.StageRunner` runs the stage over an
:class:`~medha_parallel.SPPCommunicator` with order checks on: a later stage
checks that what it receives is exactly the micro-batch its own copy of the
plan describes, and that each request's chunks arrive in order and contiguous.

Stage 0 does not wait for its sends (at most ``max_inflight`` outstanding): it
answers the driver as soon as its share is done, which lets the driver issue
the next batch while this one runs on the later stages.

Every rank applies the same plans in the same order, so the chunk counters
agree on every stage; a request whose state is dropped (finished, preempted,
released) starts again at chunk 0.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from typing import Any

import torch

from medha_parallel import ChunkMeta, MicroBatch, ParallelState, SPPCommunicator, StageRunner
from medha_runtime.model import ForwardBatch, KVCache
from medha_runtime.plan import StepPlan


def seq_id(request_id: str) -> int:
    """A request's id in chunk headers: 63 bits of a hash of it (the same on every rank)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class PipelineStage:
    """This rank's stage: a :class:`StageRunner` with the request headers of each plan.

    Args:
        state: this rank's parallel state (``spp > 1``).
        model: this stage's model (``model(batch, kv, hidden)``).
        kv: this stage's KV cache.
        hidden_size: width of the hidden states that cross stages.
        max_inflight: batches whose sends may be outstanding on a stage.
    """

    def __init__(
        self,
        state: ParallelState,
        model: Any,
        kv: KVCache,
        *,
        hidden_size: int,
        max_inflight: int = 2,
    ) -> None:
        self.comm = SPPCommunicator(state, max_inflight=max_inflight, check_order=True)
        self.model, self.kv, self.hidden_size = model, kv, hidden_size
        self.runner = StageRunner(
            self.comm,
            self._layers,
            embed=self._embed,
            expect=self._expect,
            keep_timeline=False,
        )
        #: request id -> (its seq_id, hashed once; its next chunk index)
        self._chunks: dict[str, tuple[int, int]] = {}
        self._batches = 0
        self._stream_pos = 0
        self._batch: ForwardBatch | None = None
        #: wall seconds the last :meth:`run` spent before this stage's layers
        #: started (waiting for the previous stage's activations)
        self.wait_s = 0.0
        #: thread CPU seconds the last :meth:`run` spent in that wait (the shared-memory
        #: receive spins, yielding its core, before it sleeps: CPU on an idle core)
        self.wait_cpu_s = 0.0
        self._t0 = 0.0

    @property
    def is_last(self) -> bool:
        return self.comm.is_last

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests whose state is gone: their next chunk is chunk 0 again."""
        for rid in request_ids:
            if (tracked := self._chunks.pop(rid, None)) is not None:
                self.comm.forget(tracked[0])

    def micro_batch(self, plan: StepPlan) -> MicroBatch:
        """The plan's header: one :class:`ChunkMeta` per chunk (advances the counters)."""
        metas = []
        for c in plan.chunks:
            rid = c.request_id
            tracked = self._chunks.get(rid)
            seq, idx = (seq_id(rid), 0) if tracked is None else tracked
            self._chunks[rid] = (seq, idx + 1)
            metas.append(
                ChunkMeta(
                    seq,
                    idx,
                    c.start,
                    c.num_tokens,
                    is_last=c.sample is not None,
                )
            )
        batch = MicroBatch(self._batches, self._stream_pos, tuple(metas))
        self._batches += 1
        self._stream_pos += batch.num_tokens
        return batch

    def run(self, plan: StepPlan, batch: ForwardBatch) -> torch.Tensor:
        """Run the stage on one step: ``[num_tokens, hidden_size]`` hidden states
        (sent on to the next stage) or, on the last stage, the sampled rows' logits."""
        self._batch = batch
        self._t0 = time.perf_counter()
        self.wait_s = 0.0
        stats = self.comm.stats
        spun = stats.recv_wait_cpu_s
        try:
            _, out = self.runner.step(self.micro_batch(plan), batch)
        finally:
            self._batch = None
            self.wait_cpu_s = stats.recv_wait_cpu_s - spun
        return out["logits" if self.comm.is_last else "hidden"]

    def drain(self) -> None:
        """Wait for every outstanding send."""
        self.comm.drain()

    # StageRunner callbacks ---------------------------------------------------------
    def _embed(self, meta: Any, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        return {}  # the first stage's model embeds the batch's token ids itself

    def _expect(self, meta: Any) -> dict[str, tuple[int, int]]:
        return {"hidden": (meta.num_tokens, self.hidden_size)}

    def _layers(self, meta: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert self._batch is not None
        self.wait_s = time.perf_counter() - self._t0
        out = self.model(self._batch, self.kv, inputs.get("hidden"))
        return {"logits" if self.comm.is_last else "hidden": out}
