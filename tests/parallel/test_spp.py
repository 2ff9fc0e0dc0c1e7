"""Stream pipeline parallelism: chunk header, SPPCommunicator and StageRunner on gloo.

Each distributed test is one 2-rank launch running several sub-cases.
"""

from __future__ import annotations

import mmap
import struct
import time
from pathlib import Path

import pytest
import torch

from medha_parallel import shm
from medha_parallel.spp import SPPCommunicator, SPPProtocolError, SPPStats
from medha_parallel.spp_header import (
    HEADER_WORDS,
    MAX_TENSORS,
    ChunkHeaderError,
    ChunkMeta,
    MicroBatch,
    TensorSpec,
    decode_header,
    encode_header,
    header_words,
)
from tests.numerics import assert_twice_torch

from .dist import launch
from .toy import ToyConfig, ToyModel, make_tokens


@pytest.fixture
def one_thread():
    """Tiny ops run far faster on one intra-op thread, above all on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- header (no processes) ---------------------------------------------------------


def test_header_round_trip_keeps_meta_dtypes_shapes_and_sorted_names() -> None:
    meta = ChunkMeta(seq_id=7, chunk_idx=3, start_pos=96, num_tokens=32, is_last=True, kind=1)
    tensors = {
        "hidden": torch.randn(32, 16),
        "a_bf16": torch.randn(2, 3, 4, 5).to(torch.bfloat16),
        "positions": torch.arange(32),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 16),
    }
    header = encode_header(meta, tensors)
    assert header.dtype == torch.int64 and header.shape == (HEADER_WORDS,)
    got_meta, specs = decode_header(header)
    assert got_meta == meta
    assert [s.name for s in specs] == sorted(tensors)
    for spec in specs:
        assert spec.dtype == tensors[spec.name].dtype
        assert spec.shape == tuple(tensors[spec.name].shape)
    empty_meta, empty_specs = decode_header(encode_header(ChunkMeta(0, 0, 0, 0), {}))
    assert empty_meta == ChunkMeta(0, 0, 0, 0) and empty_specs == []


def test_header_rejects_bad_input_with_clear_errors() -> None:
    meta = ChunkMeta(seq_id=0, chunk_idx=0, start_pos=0, num_tokens=4)
    good = encode_header(meta, {"hidden": torch.zeros(4, 16)})
    bad = good.clone()
    bad[0] = 12345
    with pytest.raises(ChunkHeaderError, match="bad magic"):
        decode_header(bad)
    truncated = good.clone()
    truncated[-1] = 0  # what a short message leaves in a zeroed buffer
    with pytest.raises(ChunkHeaderError, match="truncated"):
        decode_header(truncated)
    with pytest.raises(ChunkHeaderError, match=r"int64 \["):
        decode_header(good[:-1])
    too_many = good.clone()
    too_many[8] = MAX_TENSORS + 1
    with pytest.raises(ChunkHeaderError, match="tensors"):
        decode_header(too_many)
    bad_dtype = good.clone()
    bad_dtype[13] = 99
    with pytest.raises(ChunkHeaderError, match="dtype code"):
        decode_header(bad_dtype)
    with pytest.raises(ChunkHeaderError, match="dims"):
        encode_header(meta, {"x": torch.zeros(1, 1, 1, 1, 1)})
    with pytest.raises(ChunkHeaderError, match="ASCII"):
        encode_header(meta, {"x" * 25: torch.zeros(1)})
    with pytest.raises(ChunkHeaderError, match="at most"):
        encode_header(meta, {f"t{i}": torch.zeros(1) for i in range(MAX_TENSORS + 1)})
    with pytest.raises(ChunkHeaderError, match=r"ChunkMeta\.kind must fit in int64, got 92233"):
        ChunkMeta(seq_id=0, chunk_idx=0, start_pos=0, num_tokens=1, kind=2**63)
    with pytest.raises(ChunkHeaderError, match=r"ChunkMeta\.seq_id must fit in int64"):
        ChunkMeta(seq_id=-(2**63) - 1, chunk_idx=0, start_pos=0, num_tokens=1)
    with pytest.raises(ChunkHeaderError, match="chunk_idx"):
        ChunkMeta(seq_id=0, chunk_idx=-1, start_pos=0, num_tokens=1)
    specs = [TensorSpec("b", torch.float32, (1,)), TensorSpec("a", torch.float32, (1,))]
    with pytest.raises(ChunkHeaderError, match="not sorted"):
        header_words(meta, specs)
    x = torch.zeros(1)
    assert header_words(meta, specs[::-1]) == encode_header(meta, {"a": x, "b": x}).tolist()


def test_micro_batch_parts_round_trip_and_reject_bad_input() -> None:
    chunks = (ChunkMeta(5, 2, 64, 32), ChunkMeta(9, 7, 300, 1, is_last=True, kind=1))
    batch = MicroBatch(3, 1000, chunks)
    assert batch.num_tokens == 33 and batch.summary() == ChunkMeta(-1, 3, 1000, 33)
    assert MicroBatch.from_parts(batch.summary(), batch.chunks_tensor()) == batch
    assert batch.chunks_tensor().reshape(-1).tolist() == batch.chunk_words()
    assert MicroBatch.from_words(batch.summary(), batch.chunk_words()) == batch
    with pytest.raises(ChunkHeaderError, match="rows of 6"):
        MicroBatch.from_words(batch.summary(), batch.chunk_words()[:-1])
    with pytest.raises(ChunkHeaderError, match="is_last must be 0 or 1"):
        MicroBatch.from_words(batch.summary(), [*batch.chunk_words()[:-2], 2, 1])
    with pytest.raises(ChunkHeaderError, match="announces 34 tokens"):
        MicroBatch.from_parts(ChunkMeta(-1, 3, 1000, 34), batch.chunks_tensor())
    with pytest.raises(ChunkHeaderError, match="one chunk per sequence"):
        MicroBatch(0, 0, (ChunkMeta(5, 0, 0, 1), ChunkMeta(5, 1, 1, 1)))
    with pytest.raises(ChunkHeaderError, match="seq_id >= 0"):
        MicroBatch(0, 0, (ChunkMeta(-1, 0, 0, 1),))
    with pytest.raises(ChunkHeaderError, match="at least one chunk"):
        MicroBatch(0, 0, ())


def test_toy_model_chunked_equals_full(one_thread) -> None:
    model = ToyModel(ToyConfig(compute_weight=2, burn_dim=32))
    tokens = make_tokens(40)
    full = model.forward_full(tokens)
    truth = model.forward_reference(tokens)
    assert_twice_torch(model.forward_chunked(tokens, 10), truth, full, what="chunked hidden")
    assert torch.equal(ToyModel(ToyConfig()).forward_full(tokens), full)  # extra work only


# -- SPP2 end to end ------------------------------------------------------------------

PROMPT, CHUNK, DECODES = 128, 32, 3
# ~10-20 ms of compute per chunk and stage, so the overlap check survives a busy machine.
CFG = ToyConfig(compute_weight=64, burn_dim=512)


def _chunks() -> list[tuple[ChunkMeta, torch.Tensor]]:
    tokens = make_tokens(PROMPT + DECODES)
    out = []
    for i, lo in enumerate(range(0, PROMPT, CHUNK)):
        meta = ChunkMeta(0, i, lo, CHUNK, is_last=lo + CHUNK == PROMPT, kind=0)
        out.append((meta, tokens[lo : lo + CHUNK]))
    for j in range(DECODES):  # decode micro-batches: one token each, through the same path
        pos = PROMPT + j
        out.append((ChunkMeta(0, len(out), pos, 1, is_last=True, kind=1), tokens[pos : pos + 1]))
    return out


def _spp2(rank: int, world_size: int, init: str) -> dict:
    import torch.distributed as dist

    from medha_parallel import ParallelLayout, ParallelState
    from medha_parallel.spp import SPPCommunicator, StageRunner

    state = ParallelState.initialize(
        ParallelLayout(spp=2),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout_s=30,
    )
    model = ToyModel(CFG)
    comm = SPPCommunicator(state, max_inflight=2)
    stage = model.make_stage(comm.stage, comm.num_stages)
    done: list[tuple[int, float]] = []
    runner = StageRunner(
        comm,
        lambda meta, x: {"hidden": model.forward_stage(stage, x["hidden"], meta.start_pos)},
        embed=lambda meta, toks: {"hidden": model.embed(toks, meta.start_pos)},
        on_stage_done=lambda meta: done.append((meta.chunk_idx, time.perf_counter())),
    )
    out: dict = {
        "stage": comm.stage,
        "prev": comm.prev,
        "next": comm.next,
        "first_last": (comm.is_first, comm.is_last),
    }
    dist.barrier()
    results = runner.run(_chunks())
    out["timeline"] = [
        (t.meta.chunk_idx, t.wait_start, t.start, t.end, t.sent) for t in runner.timeline
    ]
    out["metas"] = [m for m, _ in results]
    out["hidden"] = [y["hidden"] for _, y in results]
    out["done"] = done
    out["inflight_after_drain"] = comm.inflight
    out["stats"] = comm.stats

    # Backpressure: stage 1 is slow, stage 0 sends as fast as it can.
    dist.barrier()
    comm2 = SPPCommunicator(state, max_inflight=2)
    if comm2.is_first:
        handles, seen = [], []
        for i in range(8):
            meta = ChunkMeta(1, i, i * 4, 4)
            handles.append(comm2.send_chunk(meta, {"hidden": torch.full((4, 16), float(i))}))
            seen.append(comm2.inflight)
        out["bp_seen"] = seen
        comm2.drain()
        out["bp_all_done"] = all(h.is_completed() for h in handles)
        out["bp_inflight_after_drain"] = comm2.inflight
    else:
        vals = []
        for _ in range(8):
            time.sleep(0.03)
            _, t = comm2.recv_chunk(expect={"hidden": (4, 16)})
            vals.append(t["hidden"][0, 0].item())
        out["bp_values"] = vals
    out["bp_stats"] = comm2.stats
    return out


def test_spp2_matches_oracle_overlaps_and_bounds_inflight(one_thread) -> None:
    s0, s1 = launch(_spp2, 2)
    assert (s0["stage"], s0["prev"], s0["next"], s0["first_last"]) == (0, None, 1, (True, False))
    assert (s1["stage"], s1["prev"], s1["next"], s1["first_last"]) == (1, 0, None, (False, True))

    # Every chunk (prompt and decode) leaves the last stage equal to the oracle.
    chunks = _chunks()
    assert s1["metas"] == [m for m, _ in chunks]
    tokens = make_tokens(PROMPT + DECODES)
    ref = ToyModel(ToyConfig()).forward_full(tokens)
    truth = ToyModel(ToyConfig()).forward_reference(tokens)
    got = torch.cat(s1["hidden"])
    assert_twice_torch(got, truth, ref, what="SPP2 hidden states")
    assert [m.kind for m in s1["metas"]].count(1) == DECODES

    # Stream pipelining: stage 0 starts chunk i+1 before stage 1 finishes chunk i.
    t0 = {c: (ws, st, en, se) for c, ws, st, en, se in s0["timeline"]}
    t1 = {c: (ws, st, en, se) for c, ws, st, en, se in s1["timeline"]}
    for i in range(PROMPT // CHUNK - 1):
        assert t0[i + 1][1] < t1[i][2], f"no overlap at chunk {i}: {t0[i + 1]} vs {t1[i]}"
    for c in t1:  # causality sanity: stage 1 computes a chunk only after stage 0 made it
        assert t1[c][1] >= t0[c][2]
    # on_stage_done fires on stage 0 once per chunk, in order, after its compute.
    assert [c for c, _ in s0["done"]] == list(range(len(chunks)))
    assert all(t >= t0[c][2] for c, t in s0["done"])
    assert s1["done"] == []

    # max_inflight respected; drain leaves nothing outstanding.
    assert 1 <= s0["stats"].peak_inflight <= 2
    assert s0["stats"].chunks_sent == len(chunks) and s1["stats"].chunks_received == len(chunks)
    assert s0["inflight_after_drain"] == 0
    assert max(s0["bp_seen"]) == 2 and s0["bp_stats"].peak_inflight == 2
    assert s0["bp_stats"].backpressure_waits >= 1
    assert s0["bp_all_done"] and s0["bp_inflight_after_drain"] == 0
    assert s1["bp_values"] == [float(i) for i in range(8)]


# -- failures ---------------------------------------------------------------------------


def _errors(rank: int, world_size: int, init: str, flag: str) -> dict:
    from medha_parallel import CommunicationError, ParallelLayout, ParallelState
    from medha_parallel.spp import SPPCommunicator

    state = ParallelState.initialize(
        ParallelLayout(spp=2),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout_s=3,
    )
    comm = SPPCommunicator(state)
    out: dict = {}

    def record(key: str, fn) -> None:
        try:
            fn()
            out[key] = None
        except Exception as exc:
            out[key] = (type(exc).__name__, isinstance(exc, CommunicationError), str(exc))

    h = {"hidden": torch.zeros(4, 16)}
    if rank == 0:
        record("recv_on_first", comm.recv_chunk)
        comm.send_chunk(ChunkMeta(10, 0, 0, 4), h)  # shape the receiver does not expect
        comm.send_chunk(ChunkMeta(11, 0, 0, 4), {**h, "extra": torch.ones(2)})  # one too many
        comm.send_chunk(ChunkMeta(12, 0, 0, 4), h)
        comm.send_chunk(ChunkMeta(12, 2, 8, 4), h)  # chunk 1 skipped
        comm.send_chunk(ChunkMeta(13, 1, 4, 4), h)  # a sequence starting mid-way
        comm.send_chunk(ChunkMeta(14, 0, 0, 4), h)  # the stream is still in step
        record("reserved", lambda: comm.send_chunk(ChunkMeta(-1, 0, 0, 4), h))
        mb = (ChunkMeta(20, 0, 0, 3), ChunkMeta(21, 0, 5, 1, is_last=True, kind=1))
        comm.send_chunk(MicroBatch(0, 0, mb), h)  # two sequences in one forward pass
        mb = (ChunkMeta(20, 1, 3, 2), ChunkMeta(21, 2, 6, 2))  # seq 21 skips chunk 1
        comm.send_chunk(MicroBatch(1, 4, mb), h)
        comm.drain()
        out["inflight"] = comm.inflight
        deadline = time.monotonic() + 30  # stay alive (PG open) until rank 1 timed out
        while not Path(flag).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        record("send_on_last", lambda: comm.send_chunk(ChunkMeta(0, 0, 0, 4), h))
        record("shape", lambda: comm.recv_chunk(expect={"hidden": (4, 8)}))
        record("count", lambda: comm.recv_chunk(expect={"hidden": (None, 16)}))
        record("in_order", comm.recv_chunk)
        record("skipped", comm.recv_chunk)
        record("midway", comm.recv_chunk)
        record("still_in_step", lambda: comm.recv_chunk(expect={"hidden": (4, 16)}))
        got = comm.recv_chunk(expect={"hidden": (4, 16)})
        out["micro_batch"] = (got[0], sorted(got[1]))
        record("mb_skipped", comm.recv_chunk)
        t = time.perf_counter()
        record("timeout", comm.recv_chunk)  # nobody sends: the group timeout fires
        out["timeout_s"] = time.perf_counter() - t
        Path(flag).write_text("done")
    return out


def test_spp_failures_raise_clear_errors_and_do_not_hang(tmp_path: Path) -> None:
    s0, s1 = launch(_errors, 2, str(tmp_path / "flag"), timeout=60)
    assert s0["recv_on_first"][0] == "ValueError" and "first stage" in s0["recv_on_first"][2]
    assert s0["inflight"] == 0
    assert s1["send_on_last"][0] == "ValueError" and "last stage" in s1["send_on_last"][2]
    name, is_comm, msg = s1["shape"]
    assert name == "SPPProtocolError" and is_comm and "'hidden'" in msg and "[4, 8]" in msg
    name, is_comm, msg = s1["count"]
    assert name == "SPPProtocolError" and "2 tensors" in msg and "expects 1" in msg
    assert s1["in_order"] is None
    name, _, msg = s1["skipped"]
    assert name == "SPPProtocolError" and "expected chunk_idx 1" in msg and "out of order" in msg
    name, _, msg = s1["midway"]
    assert name == "SPPProtocolError" and "expected 0" in msg
    assert s1["still_in_step"] is None
    name, _, msg = s0["reserved"]
    assert name == "ChunkHeaderError" and "reserved" in msg
    meta, names = s1["micro_batch"]
    assert names == ["hidden"] and isinstance(meta, MicroBatch)
    assert [(c.seq_id, c.start_pos, c.num_tokens, c.is_last) for c in meta.chunks] == [
        (20, 0, 3, False),
        (21, 5, 1, True),
    ]
    name, _, msg = s1["mb_skipped"]
    assert name == "SPPProtocolError" and "seq 21 expected chunk_idx 1" in msg
    name, is_comm, msg = s1["timeout"]
    assert name == "CommunicationError" and is_comm
    assert "spp" in msg and "recv" in msg and "Timed out" in msg
    assert 2.0 < s1["timeout_s"] < 15.0


# -- shared memory between the stages --------------------------------------------


def _payloads() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        {"hidden": torch.randn(1, 16, generator=g)},  # a decode step's activations
        {"hidden": torch.randn(3, 16, generator=g).to(torch.bfloat16), "ids": torch.arange(5)},
        {"hidden": torch.randn(64, 64, generator=g), "empty": torch.zeros(0, 4)},  # 16 KiB
        {"hidden": torch.randn(2, 8, generator=g).t()},  # not contiguous
        {"mask": torch.tensor([True, False, True]), "hidden": torch.randn(1, 16, generator=g)},
    ]


def _batch_payloads() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(8)
    return [
        {"hidden": torch.randn(3, 16, generator=g)},  # fits a slot
        {"hidden": torch.randn(3, 512, generator=g)},  # 6 KiB: follows over gloo
    ]


def _shared_meta(i: int) -> ChunkMeta | MicroBatch:
    """Plain chunks of seq 3 for :func:`_payloads`, then micro-batches of seqs 4 and 5."""
    if i < len(_payloads()):
        return ChunkMeta(3, i, i, 1, is_last=i % 2 == 1, kind=1)
    j = i - len(_payloads())
    chunks = (ChunkMeta(4, j, 2 * j, 2), ChunkMeta(5, j, 7 + j, 1, is_last=True, kind=1))
    return MicroBatch(j, 3 * j, chunks)


def _shared(rank: int, world_size: int, init: str) -> dict:
    from medha_parallel import ParallelLayout, ParallelState
    from medha_parallel.spp import SPPCommunicator

    state = ParallelState.initialize(
        ParallelLayout(spp=2),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout_s=30,
    )
    out: dict = {}
    # 4 KiB slots: the 16 KiB payload follows its header over gloo.
    for name, kw in (("shm", {"slot_bytes": 4096}), ("gloo", {"shared_memory": False})):
        comm = SPPCommunicator(state, max_inflight=2, **kw)
        out[f"{name}_uses"] = comm.uses_shared_memory
        got = []
        for i, tensors in enumerate(_payloads() + _batch_payloads()):
            meta = _shared_meta(i)
            if comm.is_first:
                comm.send_chunk(meta, tensors)
            else:
                m, t = comm.recv_chunk()
                got.append((m, t))
        if comm.is_first:
            comm.drain()
            out[f"{name}_inflight"] = comm.inflight
        out[name] = got
        out[f"{name}_stats"] = comm.stats
    return out


def test_shared_memory_carries_chunks_like_gloo(one_thread) -> None:
    s0, s1 = launch(_shared, 2)
    assert s0["shm_uses"] and s1["shm_uses"]  # both stages on this host
    assert not s0["gloo_uses"] and not s1["gloo_uses"]
    assert s0["shm_inflight"] == 0 and s0["gloo_inflight"] == 0
    for name in ("shm", "gloo"):
        payloads = _payloads() + _batch_payloads()
        assert len(s1[name]) == len(payloads)
        for i, ((meta, got), sent) in enumerate(zip(s1[name], payloads, strict=True)):
            assert meta == _shared_meta(i)
            assert sorted(got) == sorted(sent)
            for key, t in sent.items():
                assert got[key].dtype == t.dtype and got[key].shape == t.shape, (name, i, key)
                assert torch.equal(got[key], t), (name, i, key)
                assert got[key].is_contiguous()
        assert s0[f"{name}_stats"].bytes_sent == s1[f"{name}_stats"].bytes_received
    # the receive's wait (a spin, then a futex sleep) is measured where it happens
    spin = s1["shm_stats"].recv_wait_cpu_s
    assert 0 < spin <= s1["shm_stats"].recv_s
    assert s1["gloo_stats"].recv_wait_cpu_s == 0.0


@pytest.mark.skipif(not shm.supported(), reason="shared memory needs Linux x86-64")
def test_a_shared_memory_slot_announcing_more_than_it_holds_is_refused() -> None:
    # one channel in a private mapping, read by a stage-1 communicator without a group
    pipe = shm.ShmPipe(
        mmap.mmap(-1, shm.ShmPipe.nbytes(slots=1, slot_bytes=4096)),
        0,
        slots=1,
        slot_bytes=4096,
        timeout_s=1.0,
    )
    comm = SPPCommunicator.__new__(SPPCommunicator)
    comm.ranks, comm.stage, comm.device, comm.check_order = [0, 1], 1, "cpu", True
    comm.stats, comm._next, comm._in, comm.group = SPPStats(), {}, pipe, None
    big = TensorSpec("hidden", torch.float32, (64, 64))  # 16 KiB, "inline" in a 4 KiB slot
    view, _ = pipe.reserve_buffer()
    struct.pack_into(f"={HEADER_WORDS}q", view, 0, *header_words(ChunkMeta(1, 0, 0, 64), [big]))
    struct.pack_into("=q", view, 8 * HEADER_WORDS, 1)
    pipe.publish()
    with pytest.raises(SPPProtocolError, match="slot of 4096"):
        comm.recv_chunk()
    assert pipe.taken(1)  # the slot was released all the same
