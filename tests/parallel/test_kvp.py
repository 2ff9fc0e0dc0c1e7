"""KV-cache parallel attention equals full attention: pure merge, KVP2, progressive KVP3.

The oracle is single-process softmax attention in fp64 over the whole
context. KV shards are contiguous; only the tail group holds (and appends)
the chunk's own keys and attends causally.
"""

from __future__ import annotations

import itertools
import platform
import sys
import time
from pathlib import Path

import pytest
import torch

from medha_kernels import merge_states
from medha_parallel import CommunicationError, ParallelLayout, ParallelState
from medha_parallel.kvp import (
    STRATEGIES,
    KVPCommunicator,
    kvp_attention,
    kvp_paged_attention,
    plan_kvp_attention,
)
from medha_parallel.merge import merge_partials
from tests.numerics import assert_twice_torch

from .dist import launch

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
NEG_INF = float("-inf")


def _qkv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q ``[n, 4, 8]``, K and V ``[n, 2, 8]`` (fp32), the same on every process."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, NUM_QO_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: int,
    k_pos: int = 0,
    causal: bool = True,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in ``dtype`` (fp64: the truth; fp32: plain torch's baseline).

    Query i sits at ``q_pos + i``, key j at ``k_pos + j``.
    """
    group = q.shape[1] // k.shape[1]
    kk = k.to(dtype).repeat_interleave(group, dim=1)
    vv = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), kk) / HEAD_DIM**0.5
    if causal:
        qp = torch.arange(q.shape[0]) + q_pos
        kp = torch.arange(k.shape[0]) + k_pos
        scores = scores.masked_fill(kp[None, None, :] > qp[None, :, None], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [H, Nq]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)
    return out, lse.transpose(0, 1)


# ---------------------------------------------------------------- pure merge


SHARDS = [(0, 7), (7, 7), (7, 15), (15, 19)]  # contiguous, one empty


def _sharded_partials(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q, k, v = _qkv(19, seed=0)
    q_pos = 14  # a 5-token chunk at the end: causal inside the last shard
    q = q[q_pos:]
    outs, lses = [], []
    for a, b in SHARDS:
        o, s = _attention(q, k[a:b], v[a:b], q_pos=q_pos, k_pos=a)
        if a == b:  # no keys: LSE -inf; the output is 0/0 in a naive kernel
            o = torch.full_like(o, float("nan"))
        outs.append(o.to(dtype))
        lses.append(s.float())
    full = _attention(q, k, v, q_pos=q_pos)
    return torch.stack(outs), torch.stack(lses), *full


def _baseline(q, k, v, *, q_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain fp32 torch attention over the whole context: the 2x rule's baseline."""
    return _attention(q, k, v, q_pos=q_pos, dtype=torch.float32)


def _sharded_baseline() -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _qkv(19, seed=0)
    return _baseline(q[14:], k, v, q_pos=14)


def test_merge_partials_of_contiguous_shards_equals_full_attention_fp32() -> None:
    outs, lses, ref_out, ref_lse = _sharded_partials(torch.float32)
    assert torch.isnan(outs[1]).all() and (lses[1] == NEG_INF).all()  # the empty shard
    out, lse = merge_partials(outs, lses)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    base_out, base_lse = _sharded_baseline()
    assert_twice_torch(out, ref_out, base_out, what="merged output")
    assert_twice_torch(lse, ref_lse, base_lse, what="merged LSE")
    # The same contract as medha_kernels.merge_states (state axis second there).
    k_out, k_lse = merge_states(outs.transpose(0, 1), lses.transpose(0, 1), backend="torch")
    torch.testing.assert_close(out, k_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, k_lse, rtol=0, atol=1e-6)


def test_merge_partials_bf16_partials_merge_in_fp32() -> None:
    outs, lses, ref_out, ref_lse = _sharded_partials(torch.bfloat16)
    out, lse = merge_partials(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # bf16 rounding of the partials and the result only: 2x a bf16 cast of the answer.
    cast_err = (ref_out.bfloat16().double() - ref_out).abs().max().item()
    assert (out.double() - ref_out).abs().max().item() <= 2 * cast_err + 1e-3
    assert_twice_torch(lse, ref_lse, _sharded_baseline()[1], what="merged LSE")


def test_merge_partials_ignores_nan_and_inf_states_and_empties_to_zero() -> None:
    outs, lses, ref_out, ref_lse = _sharded_partials(torch.float32)
    garbage = torch.full_like(outs[0], float("nan"))
    for bad in (float("nan"), float("inf")):
        extra_outs = torch.cat([outs, garbage[None]])
        extra_lses = torch.cat([lses, torch.full_like(lses[:1], bad)])
        out, lse = merge_partials(extra_outs, extra_lses)
        base_out, base_lse = _sharded_baseline()
        assert_twice_torch(out, ref_out, base_out, what=f"output with a {bad} state")
        assert_twice_torch(lse, ref_lse, base_lse, what=f"LSE with a {bad} state")
    out, lse = merge_partials(
        garbage[None].expand(3, -1, -1, -1), torch.full_like(lses[:3], NEG_INF)
    )
    assert (out == 0).all() and (lse == NEG_INF).all()
    out, lse = merge_partials(outs[:0], lses[:0])
    assert out.shape == outs.shape[1:] and (out == 0).all() and (lse == NEG_INF).all()
    with pytest.raises(ValueError, match="num_states"):
        merge_partials(outs, lses[:, :, :2])


# ---------------------------------------------------------------- KVP2


KVP2_CONTEXT, KVP2_SPLIT = 20, 12  # group 0 holds keys 0..11, group 1 keys 12..19


def _kvp2_cases() -> dict[str, tuple[int, int]]:
    """name -> (q_start, q_end): a decode and a prefill chunk, both on the tail."""
    return {"decode": (19, 20), "prefill": (15, 20)}


def _kvp2_worker(rank: int, world_size: int, init: str) -> dict:
    layout = ParallelLayout(kvp=2)
    state = ParallelState.initialize(
        layout, backend="gloo", init_method=init, rank=rank, world_size=world_size, timeout_s=30
    )
    comm = KVPCommunicator(state)
    q_all, k, v = _qkv(KVP2_CONTEXT, seed=1)
    mine = slice(0, KVP2_SPLIT) if comm.index == 0 else slice(KVP2_SPLIT, KVP2_CONTEXT)
    res: dict = {"index": comm.index}
    for name, (start, end) in _kvp2_cases().items():
        src = q_all[start:end] if comm.index == 1 else torch.zeros(end - start, 4, 8)
        q = comm.broadcast_query(src, active=2, src_group=1)
        res[name, "q"] = q
        for dtype in (torch.float32, torch.bfloat16):
            for strategy in STRATEGIES:
                res[name, dtype, strategy] = kvp_attention(
                    q.to(dtype),
                    k[mine].to(dtype),
                    v[mine].to(dtype),
                    comm=comm,
                    active=2,
                    q_offset_local=start - KVP2_SPLIT,
                    strategy=strategy,
                    backend="torch",
                )
    # Group 1 active but still empty: group 0 holds all 12 keys, including the
    # chunk's own (keys 8..11), so it is the causal one.
    q = q_all[8:12]
    empty = k[:0]
    for strategy in STRATEGIES:
        res["empty_tail", strategy] = kvp_attention(
            q,
            k[:12] if comm.index == 0 else empty,
            v[:12] if comm.index == 0 else empty,
            comm=comm,
            active=2,
            is_tail=comm.index == 0,
            strategy=strategy,
            backend="torch",
        )
    res["paged"] = _paged_batches(comm)
    res["shm"] = comm.uses_shared_memory
    # Repeated merges of one shape (a decode step's layers): after the first, they take
    # the remembered shared-memory path; every one must merge its own states.
    repeats = []
    for i in range(5):
        gen = torch.Generator().manual_seed(100 + i)
        outs = torch.randn(2, 3, 4, 8, generator=gen)
        lses = torch.randn(2, 3, 4, generator=gen)
        lses[0, 1, 2] = float("-inf")  # a head that saw no key on group 0
        got = comm.merge(outs[comm.index], lses[comm.index], active=2)
        repeats.append((got, merge_partials(outs, lses)))
    # one query (a decode): this rank's slots are contiguous and written by address;
    # a non-contiguous state (odd repeats: a transposed copy) takes copy_; in repeats
    # 2 and 3 one group arrives 20 ms late: the other, past its spin, sleeps on the
    # futex with its sleeping word set, and the late one's exchange must wake it
    for i in range(6):
        if i in (2, 3) and comm.index == i % 2:
            time.sleep(0.02)
        gen = torch.Generator().manual_seed(200 + i)
        outs = torch.randn(2, 1, 4, 8, generator=gen)
        lses = torch.randn(2, 1, 4, generator=gen)
        lses[1 - i % 2, 0, i % 4] = float("-inf")
        out = outs[comm.index]
        if i % 2:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
            assert not out.is_contiguous()
        got = comm.merge(out, lses[comm.index], active=2)
        repeats.append((tuple(t.clone() for t in got), merge_partials(outs, lses)))
    res["repeats"] = repeats
    res["fast_paths"] = len(comm._fast)
    if comm.uses_shared_memory:  # nobody sleeps once every merge returned
        # on both ranks: a sleeper clears its own word when it wakes, which on a
        # loaded machine can be after the peer's last merge returned
        torch.distributed.barrier()
        res["sleeping"] = [w.value for w in comm._shm._sleeping]  # type: ignore[union-attr]
    gloo = KVPCommunicator(state, shared_memory=False)
    res["paged_gloo"] = _paged_batches(gloo)
    res["gloo_shm"] = gloo.uses_shared_memory
    # active == 1: group 0 alone, no collective; group 1 must be refused.
    out, lse = torch.randn(3, 4, 8), torch.randn(3, 4)
    if comm.is_active(1):
        merged = comm.merge(out, lse, active=1)
        res["active1"] = merged[0] is out and merged[1] is lse
    else:
        try:
            comm.merge(out, lse, active=1)
        except ValueError as exc:
            res["active1"] = str(exc)

    # Shared memory set up by one merge on both groups, then group 1 skips the
    # next: group 0's wait must end in a CommunicationError after the 2 s timeout.
    shared = KVPCommunicator(
        ParallelState.initialize(layout, backend="gloo", init_method=init, rank=rank, timeout_s=2)
    )
    shared.merge(out, lse.float(), active=2)
    shm_flag = Path(init.removeprefix("file://")).with_name("kvp_shm_timeout_seen")
    if rank == 0 and shared.uses_shared_memory:
        start = time.monotonic()
        try:
            shared.merge(out, lse.float(), active=2)
            res["shm_timeout"] = None
        except CommunicationError as exc:
            res["shm_timeout"] = (str(exc), time.monotonic() - start)
        shm_flag.touch()
    elif shared.uses_shared_memory:
        deadline = time.monotonic() + 60
        while not shm_flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    # Groups rebuilt with a 3 s timeout: group 1 skips the merge, group 0 must
    # get a CommunicationError (not hang); group 1 waits for it, then exits.
    short = KVPCommunicator(
        ParallelState.initialize(layout, backend="gloo", init_method=init, rank=rank, timeout_s=3)
    )
    flag = Path(init.removeprefix("file://")).with_name("kvp_timeout_seen")
    if rank == 0:
        start = time.monotonic()
        try:
            short.merge(out, lse.float(), active=2)
            res["timeout"] = None
        except CommunicationError as exc:
            res["timeout"] = (str(exc), time.monotonic() - start)
        flag.touch()
    else:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return res


# ---------------------------------------------------------------- KVP2 paged batches

BLOCK, SHARD = 4, 12  # 12-token shards of three 4-token blocks
# name -> (seed, query start, query end): keys 0..end-1 are the sequence's context.
PAGED_SEQS = {"prefill": (1, 15, 20), "decode": (1, 19, 20), "local": (2, 4, 7)}
PAGED_BATCHES = {"mixed": ("prefill", "decode", "local"), "decodes": ("decode",)}


def _paged_batches(comm: KVPCommunicator) -> dict:
    """Every batch of PAGED_BATCHES through :func:`kvp_paged_attention` on this group.

    Each sequence's shard of group ``g`` is keys ``[12 g, 12 (g + 1))`` of its
    context, written to scattered blocks of a paged cache; "local" (7 keys)
    lives on group 0 only, so group 1 holds nothing of it.
    """
    k_cache = torch.zeros(16, BLOCK, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    free = [13, 2, 7, 0, 11, 5, 9, 14, 3, 8, 1, 6]
    tables: dict[str, list[int]] = {}
    for name, (seed, _, end) in PAGED_SEQS.items():
        _, k, v = _qkv(end, seed)
        lo, hi = SHARD * comm.index, min(end, SHARD * (comm.index + 1))
        blocks = tables[name] = [free.pop() for _ in range(-(-max(0, hi - lo) // BLOCK))]
        for j in range(max(0, hi - lo)):
            k_cache[blocks[j // BLOCK], j % BLOCK] = k[lo + j]
            v_cache[blocks[j // BLOCK], j % BLOCK] = v[lo + j]
    out: dict = {}
    for batch, names in PAGED_BATCHES.items():
        seqs = [PAGED_SEQS[n] for n in names]
        q = torch.cat([_qkv(end, seed)[0][start:end] for seed, start, end in seqs])
        tails = [(end - 1) // SHARD for _, _, end in seqs]
        plan = plan_kvp_attention(
            num_q=[end - start for _, start, end in seqs],
            kv_lens=[
                max(0, min(end, SHARD * (comm.index + 1)) - SHARD * comm.index)
                for _, _, end in seqs
            ],
            is_tail=[t == comm.index for t in tails],
            block_tables=[tables[n] for n in names],
            num_qo_heads=NUM_QO_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK,
            backend="torch",
        )
        out[batch, "parts"] = [p.rows is None for p in plan.parts]
        for strategy in STRATEGIES:
            out[batch, strategy] = kvp_paged_attention(
                q, k_cache, v_cache, plan=plan, comm=comm, strategy=strategy
            )
    return out


@pytest.fixture(scope="module")
def kvp2() -> list[dict]:
    return launch(_kvp2_worker, 2)


def test_kvp2_broadcast_query_replicates_the_tail_query(kvp2) -> None:
    q_all, _, _ = _qkv(KVP2_CONTEXT, seed=1)
    for res in kvp2:
        for name, (start, end) in _kvp2_cases().items():
            assert torch.equal(res[name, "q"], q_all[start:end])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_kvp2_merge_equals_full_attention(kvp2, case, strategy) -> None:
    q_all, k, v = _qkv(KVP2_CONTEXT, seed=1)
    start, end = _kvp2_cases()[case]
    ref_out, ref_lse = _attention(q_all[start:end], k[:end], v[:end], q_pos=start)
    base_out, base_lse = _baseline(q_all[start:end], k[:end], v[:end], q_pos=start)
    qb, kb, vb = (t.bfloat16() for t in (q_all[start:end], k[:end], v[:end]))
    ref_bf16, _ = _attention(qb, kb, vb, q_pos=start)  # bf16 inputs, exact math
    for res in kvp2:
        out, lse = res[case, torch.float32, strategy]
        assert out.shape == (end - start, 4, 8) and lse.dtype == torch.float32
        assert_twice_torch(out, ref_out, base_out, what=f"{case} {strategy} output")
        assert_twice_torch(lse, ref_lse, base_lse, what=f"{case} {strategy} LSE")
        out, lse = res[case, torch.bfloat16, strategy]
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        cast_err = (ref_bf16.bfloat16().double() - ref_bf16).abs().max().item()
        assert (out.double() - ref_bf16).abs().max().item() <= 2 * cast_err + 1e-3
    # Every active group ends with the same merged state.
    assert torch.equal(
        kvp2[0][case, torch.float32, strategy][0], kvp2[1][case, torch.float32, strategy][0]
    )


def test_kvp2_empty_shard_contributes_nothing(kvp2) -> None:
    q_all, k, v = _qkv(KVP2_CONTEXT, seed=1)
    ref_out, ref_lse = _attention(q_all[8:12], k[:12], v[:12], q_pos=8)
    base_out, base_lse = _baseline(q_all[8:12], k[:12], v[:12], q_pos=8)
    for res in kvp2:
        for strategy in STRATEGIES:
            out, lse = res["empty_tail", strategy]
            assert not torch.isnan(out).any()
            assert_twice_torch(out, ref_out, base_out, what=f"{strategy} output")
            assert_twice_torch(lse, ref_lse, base_lse, what=f"{strategy} LSE")


def test_kvp2_paged_batches_equal_full_attention(kvp2) -> None:
    """Prefill chunks, decodes and a sequence one group lacks, in one planned step."""
    for batch, names in PAGED_BATCHES.items():
        truth, base = [], []
        for name in names:
            seed, start, end = PAGED_SEQS[name]
            q, k, v = _qkv(end, seed)
            truth.append(_attention(q[start:end], k, v, q_pos=start))
            base.append(_baseline(q[start:end], k, v, q_pos=start))
        ref_out, ref_lse = (torch.cat(x) for x in zip(*truth, strict=True))
        base_out, base_lse = (torch.cat(x) for x in zip(*base, strict=True))
        for res, transport in itertools.product(kvp2, ("paged", "paged_gloo")):
            for strategy in STRATEGIES:
                out, lse = res[transport][batch, strategy]
                what = f"group {res['index']} {batch} {strategy} {transport}"
                assert_twice_torch(out, ref_out, base_out, what=f"{what} output")
                assert_twice_torch(lse, ref_lse, base_lse, what=f"{what} LSE")
    # group 0: prefill on a full shard (non-causal), the rest causal; group 1 lacks
    # "local"; a step of decodes is one call over every row on both groups.
    assert kvp2[0]["paged"]["mixed", "parts"] == [False, False]
    assert kvp2[1]["paged"]["mixed", "parts"] == [False]
    assert all(res["paged"]["decodes", "parts"] == [True] for res in kvp2)


def test_plan_kvp_attention_refuses_inconsistent_sequences() -> None:
    shapes = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
    with pytest.raises(ValueError, match="one entry per sequence"):
        plan_kvp_attention(num_q=[1], kv_lens=[], is_tail=[True], block_tables=[[0]], **shapes)
    with pytest.raises(ValueError, match="tail group holds 2 keys for 3 queries"):
        plan_kvp_attention(num_q=[3], kv_lens=[2], is_tail=[True], block_tables=[[0]], **shapes)
    with pytest.raises(ValueError, match="9 keys need 3 blocks"):
        plan_kvp_attention(num_q=[1], kv_lens=[9], is_tail=[False], block_tables=[[0, 1]], **shapes)


def test_plan_kvp_attention_refuses_block_size_zero_by_name() -> None:
    """It raised ZeroDivisionError counting a sequence's blocks."""
    shapes = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 8, "block_size": 0}
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        plan_kvp_attention(num_q=[1], kv_lens=[9], is_tail=[True], block_tables=[[0]], **shapes)


def test_kvp_attention_refuses_a_tail_chunk_that_starts_before_its_shard(tmp_path) -> None:
    """A negative ``q_offset_local`` (the chunk reaching back into an earlier group's
    shard, whose keys the other groups attend to in full) gave wrong rows silently."""
    state = ParallelState.initialize(
        ParallelLayout(),
        backend="gloo",
        init_method=f"file://{tmp_path / 'init'}",
        rank=0,
        world_size=1,
    )
    try:
        comm = KVPCommunicator(state)
        q, k, v = _qkv(12, seed=2)
        with pytest.raises(ValueError, match="q_offset_local=-2: the chunk must start within"):
            kvp_attention(q[:4], k[:6], v[:6], comm=comm, active=1, q_offset_local=-2)
        out, lse = kvp_attention(q[:4], k[:6], v[:6], comm=comm, active=1, q_offset_local=2)
        ref_out, ref_lse = _attention(q[:4], k[:6], v[:6], q_pos=2)
        base_out, base_lse = _baseline(q[:4], k[:6], v[:6], q_pos=2)
        assert_twice_torch(out, ref_out, base_out, what="output")
        assert_twice_torch(lse, ref_lse, base_lse, what="LSE")
    finally:
        state.destroy()


def test_kvp2_single_active_group_is_a_no_op_and_others_are_refused(kvp2) -> None:
    assert kvp2[0]["active1"] is True
    assert "outside the active prefix" in kvp2[1]["active1"]


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the shared-memory all-gather needs Linux on x86-64",
)
def test_kvp2_whole_group_merges_go_through_shared_memory_and_time_out(kvp2) -> None:
    assert [res["shm"] for res in kvp2] == [True, True]
    assert [res["gloo_shm"] for res in kvp2] == [False, False]  # shared_memory=False
    outcome = kvp2[0]["shm_timeout"]
    assert outcome is not None, "a shared-memory merge with a missing peer returned"
    message, elapsed = outcome
    assert "merge[ag_all].all_gather on the kvp group failed" in message
    assert "did not arrive within 2 s" in message
    assert 1.5 < elapsed < 30.0, f"expected the 2 s group timeout, took {elapsed:.1f}s"


def test_kvp2_repeated_merges_of_one_shape_each_merge_their_own_states(kvp2) -> None:
    for res in kvp2:
        for (out, lse), (ref_out, ref_lse) in res["repeats"]:
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)
        if res["shm"]:  # the shared-memory path remembered the shapes it merged
            assert res["fast_paths"] >= 2
            assert res["sleeping"] == [0, 0]


def test_kvp_timeout_raises_communication_error_naming_group_and_op(kvp2) -> None:
    outcome = kvp2[0]["timeout"]
    assert outcome is not None, "merge with a missing peer returned instead of failing"
    message, elapsed = outcome
    # the default strategy with two groups: one all-gather of the packed states
    assert "merge[ag_all].all_gather" in message and "on the kvp group failed" in message
    assert 2.0 < elapsed < 30.0, f"expected the 3 s group timeout, took {elapsed:.1f}s"


# ---------------------------------------------------------------- KVP3 progressive


TOKENS_PER_GROUP = 8
# (kind, num_tokens): chunks never straddle a group boundary; the context
# grows over group 0 (0..7), group 1 (8..15) and group 2 (16..21).
SCHEDULE = [
    ("chunk", 5),
    ("chunk", 3),
    ("decode", 1),
    ("chunk", 4),
    ("decode", 1),
    ("chunk", 2),
    ("chunk", 3),
    ("decode", 1),
    ("decode", 1),
    ("decode", 1),
]
KVP3_CONTEXT = sum(n for _, n in SCHEDULE)


def _kvp3_worker(rank: int, world_size: int, init: str) -> dict:
    state = ParallelState.initialize(
        ParallelLayout(kvp=3),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout_s=30,
    )
    comm = KVPCommunicator(state)
    q_all, k_all, v_all = _qkv(KVP3_CONTEXT, seed=2)
    k_shard, v_shard = k_all[:0], v_all[:0]
    steps = []
    start = 0
    for step, (_, n) in enumerate(SCHEDULE):
        end = start + n
        tail = start // TOKENS_PER_GROUP
        assert (end - 1) // TOKENS_PER_GROUP == tail, "a chunk straddles a group boundary"
        active = tail + 1
        if comm.index == tail:  # only the tail appends the new tokens' KV
            k_shard = torch.cat([k_shard, k_all[start:end]])
            v_shard = torch.cat([v_shard, v_all[start:end]])
        if comm.is_active(active):
            src = q_all[start:end] if comm.index == tail else torch.zeros(n, 4, 8)
            q = comm.broadcast_query(src, active=active, src_group=tail)
            ref_out, ref_lse = _attention(q_all[start:end], k_all[:end], v_all[:end], q_pos=start)
            for strategy in STRATEGIES:
                out, lse = kvp_attention(
                    q,
                    k_shard,
                    v_shard,
                    comm=comm,
                    active=active,
                    q_offset_local=start - tail * TOKENS_PER_GROUP,
                    strategy=strategy,
                    backend="torch",
                )
                steps.append(
                    {
                        "step": step,
                        "active": active,
                        "strategy": strategy,
                        "out_err": (out.double() - ref_out).abs().max().item(),
                        "lse_err": (lse.double() - ref_lse).abs().max().item(),
                        "out": out,
                    }
                )
        start = end
    shard_keys = k_shard
    return {"steps": steps, "shard_keys": shard_keys, "index": comm.index}


@pytest.fixture(scope="module")
def kvp3() -> list[dict]:
    return launch(_kvp3_worker, 3)


def test_kvp3_progressive_growth_matches_full_attention_at_every_step(kvp3) -> None:
    _, k_all, _ = _qkv(KVP3_CONTEXT, seed=2)
    # The context spread over 1 -> 2 -> 3 groups; group g is active from its first token on.
    first_step = {0: 0, 1: 2, 2: 6}
    for g, res in enumerate(kvp3):
        assert res["index"] == g
        lo, hi = g * TOKENS_PER_GROUP, min((g + 1) * TOKENS_PER_GROUP, KVP3_CONTEXT)
        assert torch.equal(res["shard_keys"], k_all[lo:hi])  # contiguous, tail-appended
        seen = sorted({s["step"] for s in res["steps"]})
        assert seen == list(range(first_step[g], len(SCHEDULE)))
        for s in res["steps"]:
            assert s["out_err"] < 1e-5, s
            assert s["lse_err"] < 1e-5, s
    assert {s["active"] for s in kvp3[0]["steps"]} == {1, 2, 3}
    # Active groups agree on the merged output at every step.
    for s0 in kvp3[0]["steps"]:
        for res in kvp3[1:]:
            for s in res["steps"]:
                if (s["step"], s["strategy"]) == (s0["step"], s0["strategy"]):
                    torch.testing.assert_close(s["out"], s0["out"], rtol=0, atol=1e-6)
