"""The native CPU attention kernel and the plan-once, run-per-layer API.

Accuracy follows flash-attention's rule: the error against a float64 truth is
at most twice plain torch's in the same precision, for outputs and LSEs, at odd
sizes (block sizes, head counts, head dims, lengths), with GQA, decode,
chunked prefill, non-causal shards and empty KV.
"""

from __future__ import annotations

import pytest
import torch

import medha_kernels as mk
from medha_kernels import KernelInputError, plan_paged_attention

from .reference import assert_twice_torch, attention_ref, paged_to_dense

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF = float("inf")

pytestmark = pytest.mark.skipif(
    "native" not in mk.available_backends("cpu"), reason="no C++ toolchain for the native backend"
)


def _check(o, lse, q, k, v, *, q_offset, causal, what="") -> None:
    truth_o, truth_lse = attention_ref(q, k, v, q_offset=q_offset, causal=causal)
    base_o, base_lse = attention_ref(q, k, v, q_offset=q_offset, causal=causal, upcast=False)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert o.shape == q.shape and lse.shape == q.shape[:2]
    assert_twice_torch(o, truth_o, base_o, what=f"{what} o")
    assert_twice_torch(lse, truth_lse, base_lse, what=f"{what} lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_q", "num_kv", "hq", "hkv", "d"),
    [
        (1, 1, 1, 1, 8),
        (7, 13, 6, 2, 24),
        (37, 100, 9, 3, 64),
        (5, 5, 5, 5, 17),
        (130, 300, 3, 1, 40),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_prefill_vs_float64(dtype, num_q, num_kv, hq, hkv, d, causal) -> None:
    q = torch.randn(num_q, hq, d).to(dtype)
    k = torch.randn(num_kv, hkv, d).to(dtype)
    v = torch.randn(num_kv, hkv, d).to(dtype)
    o, lse = mk.chunked_prefill_attention(q, k, v, causal=causal, backend="native")
    _check(o, lse, q, k, v, q_offset=num_kv - num_q, causal=causal)


@pytest.mark.parametrize("q_offset", [-3, 0, 11, 40])
def test_chunk_anywhere_rows_before_every_key_are_empty(q_offset) -> None:
    """Queries at positions < 0 see no key: exactly (0, -inf), never NaN."""
    q, k, v = torch.randn(9, 4, 16), torch.randn(41, 2, 16), torch.randn(41, 2, 16)
    o, lse = mk.chunked_prefill_attention(q, k, v, q_offset=q_offset, backend="native")
    _check(o, lse, q, k, v, q_offset=q_offset, causal=True)
    empty = max(0, -q_offset)
    assert torch.equal(o[:empty], torch.zeros_like(o[:empty]))
    assert torch.equal(lse[:empty], torch.full_like(lse[:empty], -INF))


def test_empty_kv_is_the_empty_state() -> None:
    q = torch.randn(3, 6, 8)
    o, lse = mk.chunked_prefill_attention(
        q, torch.randn(0, 3, 8), torch.randn(0, 3, 8), causal=False, backend="native"
    )
    assert torch.equal(o, torch.zeros_like(q))
    assert torch.equal(lse, torch.full((3, 6), -INF))


def _paged_batch(chunks, kv_lens, hq, hkv, d, block_size, dtype, spare_blocks=3):
    """A batch whose blocks are shuffled through a cache with unused (garbage) blocks."""
    need = [-(-n // block_size) for n in kv_lens]
    total = sum(need) + spare_blocks
    perm = torch.randperm(total).to(torch.int32)
    table = torch.full((len(kv_lens), max([*need, 1])), 10**6, dtype=torch.int32)  # unused: junk
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    k_cache = torch.randn(total, block_size, hkv, d).to(dtype)
    v_cache = torch.randn(total, block_size, hkv, d).to(dtype)
    q = torch.randn(sum(chunks), hq, d).to(dtype)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), table


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("block_size", "hq", "hkv", "d"), [(1, 3, 1, 8), (3, 6, 2, 24), (7, 9, 3, 64), (16, 5, 5, 33)]
)
@pytest.mark.parametrize("causal", [True, False])
def test_paged_mixed_batch_vs_float64(dtype, block_size, hq, hkv, d, causal) -> None:
    """Decodes, chunks, a zero-query sequence and an empty one, in one call."""
    chunks = [1, 17, 0, 1, 5, 0, 64]
    kv_lens = [1, 40, 9, 77, 5, 0, 129]
    q, kc, vc, cu, lens, table = _paged_batch(chunks, kv_lens, hq, hkv, d, block_size, dtype)
    o, lse = mk.paged_attention(
        q,
        kc,
        vc,
        cu_seqlens_q=cu,
        kv_lens=lens,
        block_table=table,
        causal=causal,
        backend="native",
    )
    for b, n in enumerate(kv_lens):
        lo, hi = int(cu[b]), int(cu[b + 1])
        k, v = paged_to_dense(kc, table[b], n), paged_to_dense(vc, table[b], n)
        _check(
            o[lo:hi],
            lse[lo:hi],
            q[lo:hi],
            k,
            v,
            q_offset=n - (hi - lo),
            causal=causal,
            what=f"seq {b}",
        )


# --- large chunks: torch's CPU flash op (medha_kernels.native.cpu_flash) ---------------


def _count_flash(monkeypatch) -> list[int]:
    """Count the calls that go to torch's flash op (the native module's own reference)."""
    from medha_kernels.native import attention as native_attn

    calls: list[int] = []
    real = native_attn.flash_attention

    def counted(q, *args):
        calls.append(q.shape[0])
        return real(q, *args)

    monkeypatch.setattr(native_attn, "flash_attention", counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("num_q", "num_kv", "q_offset", "causal", "hq", "hkv", "d"),
    [
        (728, 728, 0, True, 9, 3, 64),  # the whole prompt: the causal triangle alone
        (300, 1800, 1500, True, 6, 2, 40),  # a chunk after a 1,500-key prefix: merged
        (260, 2100, 40, False, 4, 4, 24),  # non-causal (a KVP shard), no GQA
        (257, 2100, 0, True, 5, 1, 33),  # keys past the chunk are not seen
    ],
)
def test_large_chunks_go_to_torch_flash_and_match_float64(
    monkeypatch, dtype, num_q, num_kv, q_offset, causal, hq, hkv, d
) -> None:
    calls = _count_flash(monkeypatch)
    q = torch.randn(num_q, hq, d).to(dtype)
    k, v = torch.randn(num_kv, hkv, d).to(dtype), torch.randn(num_kv, hkv, d).to(dtype)
    o, lse = mk.chunked_prefill_attention(
        q, k, v, q_offset=q_offset, causal=causal, backend="native"
    )
    assert calls == [num_q]
    _check(o, lse, q, k, v, q_offset=q_offset, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("num_q", "num_kv", "q_offset"),
    [
        (1000, 952, -48),  # a KVP tail shard whose chunk began on the shard before
        (1024, 600, None),  # more queries than keys: the default offset is -424
        (200, 3000, -5),  # was a SIGFPE inside torch's flash op (it got no key)
        (300, 3000, -300),  # every row before key 0
    ],
)
def test_large_chunks_before_key_zero_are_empty_rows_not_wrong_or_a_crash(
    monkeypatch, dtype, num_q, num_kv, q_offset
) -> None:
    """A large causal chunk with a negative ``q_offset`` went to torch's flash op with
    keys sliced from ``q_offset``: Python's negative slice gave the wrong keys (every
    row wrong) or none (the process died of a floating-point exception). Rows before
    key 0 are ``(0, -inf)``; the others go to flash from key 0."""
    calls = _count_flash(monkeypatch)
    q = torch.randn(num_q, 4, 16).to(dtype)
    k, v = torch.randn(num_kv, 2, 16).to(dtype), torch.randn(num_kv, 2, 16).to(dtype)
    o, lse = mk.chunked_prefill_attention(q, k, v, q_offset=q_offset, backend="native")
    offset = num_kv - num_q if q_offset is None else q_offset
    _check(o, lse, q, k, v, q_offset=offset, causal=True)
    empty = min(num_q, -offset)
    assert torch.equal(o[:empty], torch.zeros_like(o[:empty]))
    assert torch.equal(lse[:empty], torch.full_like(lse[:empty], -INF))
    assert all(n == num_q - empty for n in calls)  # flash sees only rows from key 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_step_splits_large_chunks_from_the_native_call(monkeypatch, dtype) -> None:
    """A step with two large chunks, decodes, a small chunk and an idle sequence: the
    large ones go to flash, the rest to one native call; every row matches float64."""
    calls = _count_flash(monkeypatch)
    chunks = [1, 300, 17, 0, 512, 1]
    kv_lens = [90, 1800, 40, 9, 1024, 1]
    q, kc, vc, cu, lens, table = _paged_batch(chunks, kv_lens, 9, 3, 32, 16, dtype)
    plan = _plan(cu, lens, table, kc, 9)
    o, lse = plan.run(q, kc, vc)
    assert calls == [300, 512]
    for b, n in enumerate(kv_lens):
        lo, hi = int(cu[b]), int(cu[b + 1])
        k, v = paged_to_dense(kc, table[b], n), paged_to_dense(vc, table[b], n)
        _check(o[lo:hi], lse[lo:hi], q[lo:hi], k, v, q_offset=n - (hi - lo), causal=True)
    calls.clear()
    only = _paged_batch([300], [1800], 9, 3, 32, 16, dtype)
    o1, lse1 = _plan(*only[3:], only[1], 9).run(*only[:3])
    assert calls == [300]  # no native call at all
    k, v = paged_to_dense(only[1], only[5][0], 1800), paged_to_dense(only[2], only[5][0], 1800)
    _check(o1, lse1, only[0], k, v, q_offset=1500, causal=True)


def _plan(cu, lens, table, kc, hq, backend="native", **kw):
    return plan_paged_attention(
        cu_seqlens_q=cu,
        kv_lens=lens,
        block_table=table,
        num_qo_heads=hq,
        num_kv_heads=kc.shape[2],
        head_dim=kc.shape[3],
        block_size=kc.shape[1],
        dtype=kc.dtype,
        backend=backend,
        **kw,
    )


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_plan_once_run_per_layer_without_host_reads(monkeypatch, backend) -> None:
    """Every layer reuses one plan; ``run`` reads nothing back to the host."""
    q, kc, vc, cu, lens, table = _paged_batch(
        [1, 1, 30, 1], [50, 3, 60, 17], 6, 2, 16, 5, torch.float32
    )
    layers = [(torch.randn_like(kc), torch.randn_like(vc)) for _ in range(3)]
    plan = _plan(cu, lens, table, kc, 6, backend=backend)
    assert plan.backend == backend
    expected = [
        mk.paged_attention(
            q, k, v, cu_seqlens_q=cu, kv_lens=lens, block_table=table, backend=backend
        )
        for k, v in layers
    ]

    def no_sync(*args, **kwargs):
        raise AssertionError("host read during a planned run")

    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "__int__", no_sync)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_sync)
    for (k, v), (o_ref, lse_ref) in zip(layers, expected, strict=True):
        o, lse = plan.run(q, k, v)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_auto_plans_native_on_cpu() -> None:
    _, kc, _, cu, lens, table = _paged_batch([2], [9], 4, 2, 8, 4, torch.float32)
    assert _plan(cu, lens, table, kc, 4, backend="auto").backend == "native"


def test_plan_validates_once_and_run_checks_shapes() -> None:
    q, kc, vc, cu, lens, table = _paged_batch([1, 4], [6, 9], 4, 2, 8, 4, torch.float32)
    with pytest.raises(KernelInputError, match=r"kv_lens\[1\]=3 is below its 4 queries"):
        _plan(cu, torch.tensor([6, 3], dtype=torch.int32), table, kc, 4)
    with pytest.raises(KernelInputError, match="needs more blocks than block_table's"):
        _plan(cu, torch.tensor([6, 99], dtype=torch.int32), table, kc, 4)
    bad = table.clone()
    bad[0, 0] = -2
    with pytest.raises(KernelInputError, match="block id -2 is negative"):
        _plan(cu, lens, bad, kc, 4)
    plan = _plan(cu, lens, table, kc, 4)
    with pytest.raises(KernelInputError, match=r"q: the plan expects \(5, 4, 8\)"):
        plan.run(q[:4], kc, vc)
    with pytest.raises(KernelInputError, match="v_cache: the plan expects"):
        plan.run(q, kc, vc[..., :4])
    with pytest.raises(KernelInputError, match="k_cache: the plan expects"):
        plan.run(q, kc[: plan.meta.max_block], vc)  # one block short of the table


def test_thread_count_does_not_change_a_bit() -> None:
    """Each row is one task's work: results are identical on 1 and 2 threads."""
    q, kc, vc, cu, lens, table = _paged_batch(
        [1] * 6 + [200], [300] * 6 + [700], 9, 3, 64, 16, torch.float32
    )
    plan = _plan(cu, lens, table, kc, 9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = plan.run(q, kc, vc)
        torch.set_num_threads(2)
        two = plan.run(q, kc, vc)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_large_scores_do_not_overflow() -> None:
    """Scores around 1e4 (a far-off max) stay finite and exact to the rule."""
    q = torch.randn(3, 2, 32) * 40
    k = torch.randn(50, 1, 32) * 40
    v = torch.randn(50, 1, 32)
    o, lse = mk.chunked_prefill_attention(q, k, v, backend="native")
    assert torch.isfinite(lse).all() and lse.abs().max() > 1e3
    _check(o, lse, q, k, v, q_offset=47, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("block_size", "hq", "hkv", "d"),
    [
        (16, 9, 3, 64),
        (7, 8, 4, 24),
        (3, 6, 2, 33),
        (1, 5, 5, 8),
        (5, 4, 1, 40),
        # the AVX-512 kernels' other chunkings: one whole 16 (tiny's heads), a masked last
        # of 4 (57), a 64-wide pass then a rest (80, 128), GQA group 5
        (16, 4, 2, 16),
        (2, 10, 2, 57),
        (16, 3, 3, 80),
        (9, 5, 1, 128),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_decode_tasks_of_all_kv_heads_vs_float64(dtype, block_size, hq, hkv, d, threads, causal):
    """Many decodes (and tiny multi-token chunks) plan one task per sequence for all its
    KV heads (KV head -1); lengths around the key tile (32) and block edges, shuffled
    non-contiguous blocks: every row matches float64."""
    from medha_kernels.native.jit import get_module

    group = hq // hkv
    tiny = max(1, 11 // group)  # the most tokens whose rows per KV head stay below 12
    chunks = [1, 1, 1, tiny, 1, 1, 1, 1, 2 if tiny >= 2 else 1, 1]
    kv_lens = [1, 31, 32, 33, 64, 65, 97, 2, 40, 200]
    q, kc, vc, cu, lens, table = _paged_batch(chunks, kv_lens, hq, hkv, d, block_size, dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        counts = cu[1:] - cu[:-1]
        tasks = get_module("cpu").plan_paged_attention(
            cu, lens, (lens - counts).to(torch.int32), hkv, group, causal
        )
        assert (tasks[:, 1] == -1).sum() == len(chunks)  # one decode task per sequence
        plan = _plan(cu, lens, table, kc, hq, causal=causal)
        o, lse = plan.run(q, kc, vc)
    finally:
        torch.set_num_threads(previous)
    for b, n in enumerate(kv_lens):
        lo, hi = int(cu[b]), int(cu[b + 1])
        k, v = paged_to_dense(kc, table[b], n), paged_to_dense(vc, table[b], n)
        _check(
            o[lo:hi],
            lse[lo:hi],
            q[lo:hi],
            k,
            v,
            q_offset=n - (hi - lo),
            causal=causal,
            what=f"seq {b}",
        )


def test_few_decodes_on_threads_keep_a_task_per_kv_head() -> None:
    """Two long decodes on two threads: a task per (sequence, KV head), so that both
    threads share the work; on one thread, one task per sequence."""
    from medha_kernels.native.jit import get_module

    ext = get_module("cpu")
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    lens = torch.tensor([9000, 8000], dtype=torch.int32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = ext.plan_paged_attention(cu, lens, lens - 1, 3, 3, True)
        torch.set_num_threads(1)
        one = ext.plan_paged_attention(cu, lens, lens - 1, 3, 3, True)
    finally:
        torch.set_num_threads(previous)
    assert sorted(two[:, :2].tolist()) == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert sorted(one[:, :2].tolist()) == [[0, -1], [1, -1]]


def test_batch_decode_at_short_context_is_shared_out_over_threads() -> None:
    """A batch-32 decode step at SmolLM2's heads and 72 keys (20,736 row-keys, ~0.4 ms on
    one core) is shared out over two threads (the plan's serial flag off); one decode of 8
    keys (72 row-keys) stays on the calling thread."""
    from medha_kernels.native.jit import get_module

    ext = get_module("cpu")

    def serial_flag(batch: int, keys: int) -> int:
        cu = torch.arange(batch + 1, dtype=torch.int32)
        lens = torch.full((batch,), keys, dtype=torch.int32)
        return int(ext.plan_paged_attention(cu, lens, lens - 1, 3, 3, True)[0, 4])

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert serial_flag(32, 72) == 0
        assert serial_flag(4, 72) == 0
        assert serial_flag(1, 8) == 1
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(("plan_threads", "run_threads"), [(1, 2), (2, 1), (2, 2)])
def test_decode_tasks_shared_out_over_threads_vs_float64(plan_threads, run_threads):
    """Decodes long enough for the parallel path (the plan's serial flag off), planned on
    one thread count and run on another; on two threads, one long decode among short ones
    keeps a task per KV head (its work is above a thread's share), the short ones take one
    task each: every row matches float64."""
    from medha_kernels.native.jit import get_module

    hq, hkv, d = 9, 3, 64
    chunks = [1] * 8
    kv_lens = [40, 2000, 45, 2600, 50, 3000, 55, 12000]
    q, kc, vc, cu, lens, table = _paged_batch(chunks, kv_lens, hq, hkv, d, 16, torch.float32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(plan_threads)
        counts = cu[1:] - cu[:-1]
        tasks = get_module("cpu").plan_paged_attention(
            cu, lens, (lens - counts).to(torch.int32), hkv, hq // hkv, True
        )
        plan = _plan(cu, lens, table, kc, hq)
        torch.set_num_threads(run_threads)
        o, lse = plan.run(q, kc, vc)
    finally:
        torch.set_num_threads(previous)
    assert int(tasks[0, 4]) == 0  # enough work to share out: the parallel path
    per_head = tasks[tasks[:, 0] == 7]
    if plan_threads == 1:
        assert (tasks[:, 1] == -1).all()
    else:  # the 12,000-key decode is over half the step's work: a task per KV head
        assert sorted(per_head[:, 1].tolist()) == [0, 1, 2]
        assert (tasks[tasks[:, 0] != 7][:, 1] == -1).all()
    for b, n in enumerate(kv_lens):
        lo, hi = int(cu[b]), int(cu[b + 1])
        k, v = paged_to_dense(kc, table[b], n), paged_to_dense(vc, table[b], n)
        _check(o[lo:hi], lse[lo:hi], q[lo:hi], k, v, q_offset=n - 1, causal=True, what=f"seq {b}")
