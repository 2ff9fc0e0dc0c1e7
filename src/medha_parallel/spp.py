"""Stream pipeline parallelism (SPP): chunks of one prompt flow stage to stage.

Chunk ``i+1`` of a prefill needs only the KV cache of earlier chunks, which
every stage keeps for its own layers, never chunk ``i``'s final output. So
stage 0 starts chunk ``i+1`` as soon as it has handed chunk ``i`` to stage 1,
and all stages work on different chunks of the same prompt at once. Only
activations cross stages.

:class:`SPPCommunicator` moves chunks between adjacent stages of one pipeline
(``state.ranks["spp"]``): ``send_chunk`` posts non-blocking sends and returns
at once (at most ``max_inflight`` chunks outstanding, then it waits for the
oldest: backpressure); ``recv_chunk`` blocks, reads the fixed-size header
(:mod:`medha_parallel.spp_header`) and allocates exactly what it announces.
Where every stage of the pipeline is a CPU process on this host, the header
and (when they fit a slot) the tensors go through a shared-memory channel
(:class:`~medha_parallel.shm.ShmPipe`) instead of gloo: a gloo message wakes
a transport thread and then the caller, which on a busy machine costs far more
than a decode step's activations take to copy. Tensors that do not fit a
slot follow the header over gloo.
:class:`StageRunner` runs the per-stage schedule::

    x = embed(chunk) if first stage else recv_chunk()
    y = layers(meta, x)              # appends this chunk's KV locally
    send_chunk(meta, y) unless last stage
    on_stage_done(meta) on the first stage  # the scheduler may issue chunk i+1

Decode micro-batches (``ChunkMeta.kind == 1`` by convention) take the same path.
A :class:`~medha_parallel.spp_header.MicroBatch` (chunks of several sequences
run in one forward pass, as a serving engine batches them) goes wherever a
``ChunkMeta`` goes: one header, its members' metas beside the tensors, and
the order of every member sequence checked on receipt.
"""

from __future__ import annotations

import ctypes
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from medha_parallel import shm
from medha_parallel.errors import CommunicationError, named_comm
from medha_parallel.spp_header import (
    CHUNKS_TENSOR,
    HEADER_WORDS,
    MICRO_BATCH_SEQ,
    ChunkHeaderError,
    ChunkMeta,
    MicroBatch,
    TensorSpec,
    decode_header,
    decode_header_words,
    encode_header,
    header_words,
    tensor_spec,
)
from medha_parallel.state import ParallelState

__all__ = [
    "HEADER_WORDS",
    "ChunkHeaderError",
    "ChunkMeta",
    "ChunkTiming",
    "MicroBatch",
    "SPPCommunicator",
    "SPPProtocolError",
    "SPPStats",
    "SendHandle",
    "StageRunner",
    "decode_header",
    "encode_header",
]

Tensors = dict[str, torch.Tensor]
#: what one send carries: one sequence's chunk, or a micro-batch of several
Meta = ChunkMeta | MicroBatch


class SPPProtocolError(CommunicationError):
    """The chunk stream broke its contract: a malformed header, a chunk out of
    order, or tensors other than the receiver expected."""


@dataclass
class SPPStats:
    """Counters and wall times of one communicator (seconds, ``time.perf_counter``).

    ``recv_s`` is time blocked in ``recv_chunk``, which includes waiting for the
    previous stage to finish its compute; ``send_s`` is time inside
    ``send_chunk`` (posting plus any backpressure wait). ``recv_wait_cpu_s`` is
    the thread CPU seconds a shared-memory receive spent waiting for its
    message: the wait spins a while (yielding its core) before it sleeps, so
    on an idle core it is CPU however little work it does.
    """

    chunks_sent: int = 0
    chunks_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_inflight: int = 0
    backpressure_waits: int = 0
    send_s: float = 0.0
    recv_s: float = 0.0
    drain_s: float = 0.0
    recv_wait_cpu_s: float = 0.0

    @property
    def comm_s(self) -> float:
        return self.send_s + self.recv_s + self.drain_s


class SendHandle:
    """One chunk's outstanding sends. Holds every buffer until they complete.

    A chunk sent through a shared-memory channel (``slot``: the channel and
    the message's sequence number) is complete once the receiver took it.
    """

    def __init__(
        self,
        meta: Meta,
        works: list[Any],
        buffers: list[torch.Tensor],
        slot: tuple[shm.ShmPipe, int] | None = None,
    ) -> None:
        self.meta = meta
        self._works = works
        self._buffers: list[torch.Tensor] | None = buffers
        self._slot = slot

    def is_completed(self) -> bool:
        if self._buffers is None:
            return True
        if self._slot is not None and not self._slot[0].taken(self._slot[1]):
            return False
        if all(w is None or w.is_completed() for w in self._works):
            self.wait()  # surfaces a failed send, releases the buffers
            return True
        return False

    def wait(self) -> None:
        """Block until every send of the chunk is done, then drop the buffers."""
        if self._buffers is None:
            return
        with named_comm("spp", "send"):
            if self._slot is not None:
                self._slot[0].wait_taken(self._slot[1])
            for w in self._works:
                if w is not None:
                    w.wait()
        self._buffers = None
        self._works = []


class SPPCommunicator:
    """Chunk transport between adjacent stages of this rank's pipeline.

    Args:
        state: this rank's :class:`ParallelState`; the pipeline is
            ``state.ranks["spp"]`` (global ranks in stage order) on
            ``state.spp_group``, whose timeout bounds every receive.
        max_inflight: chunks that may have sends outstanding at once; the next
            ``send_chunk`` waits for the oldest (backpressure, bounded memory).
        check_order: make ``recv_chunk`` check that each sequence's chunks
            arrive with consecutive ``chunk_idx`` (from 0) and contiguous
            ``start_pos`` (the members of micro-batches too, and the
            micro-batches themselves by ``index`` and ``stream_pos``).
        shared_memory: send headers, and tensors up to ``slot_bytes`` in all,
            through shared memory where every stage is a CPU process on this
            host (False: always gloo). Building the communicator is then a
            collective over the pipeline group.
        slot_bytes: the largest chunk (header and tensors) shared memory carries.

    A tensor handed to ``send_chunk`` must not be modified until its handle
    completes (``send_chunk`` does not copy contiguous tensors).
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        max_inflight: int = 2,
        check_order: bool = True,
        shared_memory: bool = True,
        slot_bytes: int = 1 << 20,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if slot_bytes < _SLOT_PREFIX:
            raise ValueError(f"slot_bytes must be >= {_SLOT_PREFIX}, got {slot_bytes}")
        if "spp" not in state.ranks or state.spp_group is None:
            raise ValueError("state has no pipeline group; build it with ParallelState.initialize")
        self.group = state.spp_group
        self.ranks: list[int] = list(state.ranks["spp"])
        self.stage = self.ranks.index(state.rank)
        self.device = state.device
        self.max_inflight = max_inflight
        self.check_order = check_order
        self.stats = SPPStats()
        self._inflight: deque[SendHandle] = deque()
        self._next: dict[int, tuple[int, int]] = {}  # seq_id -> (chunk_idx, start_pos) due
        self._out: shm.ShmPipe | None = None  # shared-memory channel to the next stage
        self._in: shm.ShmPipe | None = None  # ... from the previous one
        if shared_memory and state.device_type == "cpu" and len(self.ranks) > 1:
            pipes = shm.ShmPipe.create_chain(
                self.group,
                slots=max_inflight,
                slot_bytes=slot_bytes,
                timeout_s=state.timeout.total_seconds(),
            )
            if pipes is not None:
                self._out = None if self.is_last else pipes[self.stage]
                self._in = None if self.is_first else pipes[self.stage - 1]

    @property
    def uses_shared_memory(self) -> bool:
        """Whether chunks cross to and from this stage through shared memory."""
        return self._out is not None or self._in is not None

    # -- topology ---------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def prev(self) -> int | None:
        """Global rank of the previous stage (None on the first stage)."""
        return None if self.is_first else self.ranks[self.stage - 1]

    @property
    def next(self) -> int | None:
        """Global rank of the next stage (None on the last stage)."""
        return None if self.is_last else self.ranks[self.stage + 1]

    @property
    def inflight(self) -> int:
        """Chunks whose sends are still outstanding."""
        self._reap()
        return len(self._inflight)

    # -- sending ----------------------------------------------------------------
    def send_chunk(self, meta: Meta, tensors: Mapping[str, torch.Tensor]) -> SendHandle:
        """Post the header and tensors to the next stage; return without waiting.

        ``meta`` is one sequence's :class:`ChunkMeta` or a :class:`MicroBatch`.
        Waits first for the oldest outstanding chunk when ``max_inflight``
        chunks are already in flight.
        """
        if self.is_last:
            raise ValueError(f"stage {self.stage} is the last stage: there is no next stage")
        if CHUNKS_TENSOR in tensors:
            raise ChunkHeaderError(f"tensor name {CHUNKS_TENSOR!r} is reserved")
        if not isinstance(meta, MicroBatch) and meta.seq_id == MICRO_BATCH_SEQ:
            raise ChunkHeaderError(f"seq_id {MICRO_BATCH_SEQ} is reserved for micro-batches")
        if self._out is not None:
            message = self._shared_message(meta, tensors)
        else:
            if isinstance(meta, MicroBatch):
                tensors = {**tensors, CHUNKS_TENSOR: meta.chunks_tensor().to(self.device)}
                header = encode_header(meta.summary(), tensors).to(self.device)
            else:
                header = encode_header(meta, tensors).to(self.device)
            buffers = [header] + [tensors[name].contiguous() for name in sorted(tensors)]
        t0 = time.perf_counter()
        self._reap()
        while len(self._inflight) >= self.max_inflight:
            self.stats.backpressure_waits += 1
            self._inflight.popleft().wait()
        if self._out is not None:
            handle, nbytes = self._send_shared(meta, *message)
        else:
            dst = self.stage + 1
            with named_comm("spp", "send"):
                works = [
                    dist.isend(b, group=self.group, group_dst=dst) for b in buffers if b.numel() > 0
                ]
            handle = SendHandle(meta, works, buffers)
            nbytes = sum(b.numel() * b.element_size() for b in buffers)
        self._inflight.append(handle)
        self.stats.peak_inflight = max(self.stats.peak_inflight, len(self._inflight))
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += nbytes
        self.stats.send_s += time.perf_counter() - t0
        return handle

    def _shared_message(
        self, meta: Meta, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[list[int], list[torch.Tensor | list[int]], list[int]]:
        """What :meth:`_send_shared` writes, built with Python ints and no tensor op: the
        header words, the payloads in header order (a contiguous CPU tensor, or a
        micro-batch's ``_chunks`` rows as ints) and their byte sizes."""
        summary, rows = (
            (meta.summary(), meta.chunk_words()) if isinstance(meta, MicroBatch) else (meta, None)
        )
        names = sorted(tensors) if rows is None else sorted([*tensors, CHUNKS_TENSOR])
        specs, payloads, sizes = [], [], []
        for name in names:
            if rows is not None and name == CHUNKS_TENSOR:
                specs.append(TensorSpec(name, torch.int64, (len(rows) // 6, 6)))
                payloads.append(rows)
                sizes.append(8 * len(rows))
                continue
            t = tensors[name]
            specs.append(tensor_spec(name, t))  # staging keeps the dtype and shape
            t = t.contiguous() if t.device.type == "cpu" else t.cpu()  # stage on this host's CPU
            payloads.append(t)
            sizes.append(t.numel() * t.element_size())
        return header_words(summary, specs), payloads, sizes

    def _send_shared(
        self,
        meta: Meta,
        words: list[int],
        payloads: list[torch.Tensor | list[int]],
        sizes: list[int],
    ) -> tuple[SendHandle, int]:
        """Header (and tensors, if they fit) into the next slot; the rest over gloo.
        Returns the send's handle and its bytes."""
        assert self._out is not None
        offsets, end = _slot_layout(sizes)
        inline = end <= self._out.slot_bytes
        later: list[torch.Tensor] = []
        with named_comm("spp", "send"):
            view, addr = self._out.reserve_buffer()  # free: at most max_inflight are unread
            _HEADER.pack_into(view, 0, *words)
            _WORD.pack_into(view, _HEADER_BYTES, int(inline))
            if inline:
                for p, off, n in zip(payloads, offsets, sizes, strict=True):
                    if isinstance(p, list):
                        struct.pack_into(f"={len(p)}q", view, off, *p)
                    elif n:
                        ctypes.memmove(addr + off, p.data_ptr(), n)
            self._out.publish()
            works = []
            if not inline:
                later = [
                    torch.tensor(p, dtype=torch.int64).view(-1, 6) if isinstance(p, list) else p
                    for p in payloads
                ]
                dst = self.stage + 1
                works = [
                    dist.isend(t, group=self.group, group_dst=dst) for t in later if t.numel() > 0
                ]
        seq = self._out.published
        handle = SendHandle(meta, works, later, slot=(self._out, seq))
        return handle, _HEADER_BYTES + sum(sizes)

    def drain(self) -> None:
        """Wait for every outstanding send."""
        t0 = time.perf_counter()
        try:
            while self._inflight:
                self._inflight[0].wait()
                self._inflight.popleft()
        finally:
            self.stats.drain_s += time.perf_counter() - t0

    def _reap(self) -> None:
        while self._inflight and self._inflight[0].is_completed():
            self._inflight.popleft()

    # -- receiving --------------------------------------------------------------
    def recv_chunk(
        self, *, expect: Mapping[str, Sequence[int | None] | None] | None = None
    ) -> tuple[Meta, Tensors]:
        """Receive the next chunk (or micro-batch) from the previous stage (blocking).

        ``expect`` optionally names exactly the tensors the caller wants, each
        with a shape (``None`` for any dim, or ``None`` for any shape). A
        mismatch, or a chunk out of order, raises :class:`SPPProtocolError`
        after the whole chunk has been received, so the stream stays in step.
        A missing sender raises :class:`CommunicationError` after the group
        timeout.
        """
        if self.is_first:
            raise ValueError("stage 0 is the first stage: there is no previous stage")
        src = self.stage - 1
        t0 = time.perf_counter()
        try:
            rows: tuple[int, ...] | None = None  # a micro-batch's _chunks, read from the slot
            try:
                if self._in is not None:
                    meta, specs, tensors, rows = self._recv_shared()
                else:
                    header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=self.device)
                    with named_comm("spp", "recv"):
                        dist.recv(header, group=self.group, group_src=src)
                    (meta, specs), tensors = decode_header(header.cpu()), {}
            except ChunkHeaderError as exc:
                raise SPPProtocolError(
                    f"recv on the spp group from stage {src}: {exc}; the stream is out of "
                    "step, tear the group down"
                ) from exc
            works = []
            with named_comm("spp", "recv"):
                for spec in specs:
                    buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                    tensors[spec.name] = buf
                    if buf.numel() > 0:
                        works.append(dist.irecv(buf, group=self.group, group_src=src))
                for w in works:
                    w.wait()
        finally:
            self.stats.recv_s += time.perf_counter() - t0
        self.stats.chunks_received += 1
        self.stats.bytes_received += _HEADER_BYTES + (0 if rows is None else 8 * len(rows))
        self.stats.bytes_received += sum(t.numel() * t.element_size() for t in tensors.values())
        got: Meta = meta
        if meta.seq_id == MICRO_BATCH_SEQ:
            chunks = tensors.pop(CHUNKS_TENSOR, None)
            try:
                if rows is not None:
                    got = MicroBatch.from_words(meta, rows)
                elif chunks is None:
                    raise ChunkHeaderError(f"a micro-batch header without {CHUNKS_TENSOR!r}")
                else:
                    got = MicroBatch.from_parts(meta, chunks.cpu())
            except ChunkHeaderError as exc:
                raise SPPProtocolError(f"recv on the spp group from stage {src}: {exc}") from exc
        if expect is not None:
            self._check_expected(meta, tensors, expect)
        if self.check_order:
            self._check_order(meta)
            if isinstance(got, MicroBatch):
                for member in got.chunks:
                    self._check_order(member)
        return got, tensors

    def _recv_shared(
        self,
    ) -> tuple[ChunkMeta, list[TensorSpec], Tensors, tuple[int, ...] | None]:
        """The next slot: its header's meta (raises :class:`ChunkHeaderError`), the tensor
        specs still to receive over gloo, the tensors that came with it, and a
        micro-batch's well-formed ``_chunks`` rows as ints (else None; the tensor
        then stays among the others). The slot is released either way."""
        assert self._in is not None
        c0 = time.thread_time()
        try:
            with named_comm("spp", "recv"):
                view, addr = self._in.peek_buffer()
        finally:
            self.stats.recv_wait_cpu_s += time.thread_time() - c0
        try:
            meta, specs = decode_header_words(_HEADER.unpack_from(view, 0))
            if not _WORD.unpack_from(view, _HEADER_BYTES)[0]:  # the tensors follow over gloo
                return meta, specs, {}, None
            sizes = [math.prod(sp.shape) * sp.dtype.itemsize for sp in specs]
            offsets, end = _slot_layout(sizes)
            if end > len(view):
                raise ChunkHeaderError(
                    f"header announces {end} bytes in a slot of {len(view)}: the stream is "
                    "out of step"
                )
            tensors: Tensors = {}
            rows = None
            batch = meta.seq_id == MICRO_BATCH_SEQ
            for sp, off, n in zip(specs, offsets, sizes, strict=True):
                if (
                    batch
                    and sp.name == CHUNKS_TENSOR
                    and sp.dtype == torch.int64
                    and sp.shape[1:] == (6,)
                ):
                    rows = struct.unpack_from(f"={n // 8}q", view, off)
                    continue
                buf = torch.empty(sp.shape, dtype=sp.dtype)
                if n > 0:
                    ctypes.memmove(buf.data_ptr(), addr + off, n)
                tensors[sp.name] = buf
            return meta, [], tensors, rows
        finally:
            self._in.release()

    def forget(self, seq_id: int) -> None:
        """Stop tracking a finished sequence's chunk order."""
        self._next.pop(seq_id, None)

    def _check_order(self, meta: ChunkMeta) -> None:
        due = self._next.get(meta.seq_id)
        if due is None and meta.chunk_idx != 0:
            raise SPPProtocolError(
                f"recv on the spp group: seq {meta.seq_id} starts with chunk_idx "
                f"{meta.chunk_idx}, expected 0 (chunks out of order)"
            )
        if due is not None and (meta.chunk_idx, meta.start_pos) != due:
            raise SPPProtocolError(
                f"recv on the spp group: seq {meta.seq_id} expected chunk_idx {due[0]} at "
                f"start_pos {due[1]}, got chunk_idx {meta.chunk_idx} at start_pos "
                f"{meta.start_pos} (chunks out of order)"
            )
        self._next[meta.seq_id] = (meta.chunk_idx + 1, meta.start_pos + meta.num_tokens)

    @staticmethod
    def _check_expected(
        meta: ChunkMeta, tensors: Tensors, expect: Mapping[str, Sequence[int | None] | None]
    ) -> None:
        where = f"recv on the spp group (seq {meta.seq_id} chunk {meta.chunk_idx})"
        if set(tensors) != set(expect):
            raise SPPProtocolError(
                f"{where}: header announces {len(tensors)} tensors {sorted(tensors)}, "
                f"receiver expects {len(expect)} {sorted(expect)}"
            )
        for name, shape in expect.items():
            got = tuple(tensors[name].shape)
            if shape is None:
                continue
            if len(got) != len(shape) or any(
                s is not None and s != g for s, g in zip(shape, got, strict=True)
            ):
                raise SPPProtocolError(
                    f"{where}: tensor {name!r} has shape {list(got)}, receiver expects "
                    f"{list(shape)}"
                )


#: a shared-memory slot: the header, a word saying whether the tensors follow in the
#: slot (1) or over gloo (0), then each tensor's bytes (header order) on 64-byte bounds
_HEADER_BYTES = HEADER_WORDS * 8
_SLOT_PREFIX = _HEADER_BYTES + 8
_HEADER = struct.Struct(f"={HEADER_WORDS}q")  # native byte order, as torch's int64
_WORD = struct.Struct("=q")


def _slot_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Where each tensor's bytes start in a slot, and where the last one ends."""
    offsets, end = [], _SLOT_PREFIX
    for n in sizes:
        end = -(-end // 64) * 64
        offsets.append(end)
        end += n
    return offsets, end


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """``time.perf_counter`` stamps of one chunk on one stage.

    ``wait_start``: the stage began waiting for the chunk (recv) or embedding it;
    ``start``: its input is in hand and compute begins (after embed on stage 0);
    ``end``: compute done; ``sent``: the send is posted (``end`` on the last stage).
    """

    meta: Meta
    wait_start: float
    start: float
    end: float
    sent: float


class StageRunner:
    """Runs the SPP schedule for one stage.

    Args:
        comm: this stage's communicator.
        layers: ``layers(meta, inputs) -> outputs``: the stage's layers on one
            chunk; it appends the chunk's KV to the stage's own cache.
        embed: ``embed(meta, payload) -> inputs``: first stage only.
        on_stage_done: called with the chunk's meta once the first stage has
            finished it and posted its send: the next chunk may be issued.
        expect: ``expect(meta) -> {name: shape}``: the tensors a later stage
            must receive for a chunk (see :meth:`SPPCommunicator.recv_chunk`);
            None checks nothing.
        keep_timeline: record a :class:`ChunkTiming` per chunk (a long-running
            server turns it off).

    A chunk is one sequence's :class:`ChunkMeta` or a :class:`MicroBatch`.
    """

    def __init__(
        self,
        comm: SPPCommunicator,
        layers: Callable[[Meta, Tensors], Tensors],
        *,
        embed: Callable[[Meta, Any], Tensors] | None = None,
        on_stage_done: Callable[[Meta], None] | None = None,
        expect: Callable[[Meta], Mapping[str, Sequence[int | None] | None]] | None = None,
        keep_timeline: bool = True,
    ) -> None:
        if comm.is_first and embed is None:
            raise ValueError("the first stage needs an embed function")
        self.comm = comm
        self.layers = layers
        self.embed = embed
        self.on_stage_done = on_stage_done
        self.expect = expect
        self.keep_timeline = keep_timeline
        self.timeline: list[ChunkTiming] = []

    def step(self, meta: Meta | None = None, payload: Any = None) -> tuple[Meta, Tensors]:
        """Process one chunk; return its meta and this stage's outputs.

        The first stage needs ``meta`` and ``payload`` (e.g. token ids); later
        stages receive both meta and inputs, and check them against ``meta``
        when given (and the tensors against ``expect(meta)``).
        """
        wait_start = time.perf_counter()
        if self.comm.is_first:
            if meta is None or self.embed is None:
                raise ValueError("the first stage needs the chunk's meta and payload")
            x = self.embed(meta, payload)
        else:
            expect = None if self.expect is None or meta is None else self.expect(meta)
            got, x = self.comm.recv_chunk(expect=expect)
            if meta is not None and got != meta:
                raise SPPProtocolError(
                    f"recv on the spp group: stage {self.comm.stage} expected {meta}, got {got}"
                )
            meta = got
        start = time.perf_counter()
        y = self.layers(meta, x)
        end = time.perf_counter()
        if not self.comm.is_last:
            self.comm.send_chunk(meta, y)
        if self.keep_timeline:
            self.timeline.append(ChunkTiming(meta, wait_start, start, end, time.perf_counter()))
        if self.comm.is_first and self.on_stage_done is not None:
            self.on_stage_done(meta)
        return meta, y

    def run(self, chunks: Iterable[tuple[Meta, Any]]) -> list[tuple[Meta, Tensors]]:
        """Step through ``(meta, payload)`` chunks (later stages use the metas as
        checks and ignore payloads), then drain the sends."""
        out = [self.step(meta, payload) for meta, payload in chunks]
        self.comm.drain()
        return out
