"""The Triton backend against the float64 truth (interpreter on CPU, real kernels on CUDA).

Accuracy rule (``reference.assert_twice_torch``): a kernel's error against the
float64 truth is at most twice plain torch's in the same precision. Shapes stay
tiny because the interpreter is slow; the cases form a covering set of dtypes,
head dims (64, 128, odd), GQA ratios (1, 4, 8), lengths and chunk positions
rather than their full product.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from medha_kernels import (
    append_paged_kv,
    available_backends,
    chunked_prefill_attention,
    merge_state,
    merge_state_in_place,
    merge_states,
    paged_attention,
)

from .conftest import DEVICE
from .reference import assert_twice_torch, attention_ref, merge_ref, paged_to_dense

# triton is a test dependency and runs everywhere: compiled on CUDA, interpreted
# on CPU (the conftest sets TRITON_INTERPRET=1). A missing backend is a failure.


def test_triton_backend_is_available() -> None:
    assert "triton" in available_backends(DEVICE), "install triton (the [test] extra has it)"


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
INF = float("inf")


def _randn(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _check_attention(o, lse, q, k, v, **kw) -> None:
    o_true, lse_true = attention_ref(q, k, v, **kw)
    o_base, lse_base = attention_ref(q, k, v, upcast=False, **kw)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == F32 and lse.shape == q.shape[:2]
    assert_twice_torch(o, o_true, o_base, what="o")
    assert_twice_torch(lse, lse_true, lse_base, what="lse")
    empty = torch.isinf(lse_true)  # rows that see no key: exactly (0, -inf)
    assert torch.all(lse[empty] == -INF)
    assert torch.all(o[empty] == 0)


# --- chunked prefill -------------------------------------------------------------------

# (dtype, head_dim, group, num_q, num_kv, q_offset, causal)
CHUNKED_CASES = [
    pytest.param(F32, 64, 1, 97, 97, None, True, id="full-prefill-f32-d64-g1"),
    pytest.param(BF16, 128, 4, 16, 97, 40, True, id="middle-chunk-bf16-d128-g4"),
    pytest.param(F16, 59, 8, 1, 97, None, True, id="end-decode-f16-d59-g8"),
    pytest.param(BF16, 40, 4, 33, 300, 0, True, id="start-chunk-splitkv-bf16-d40-g4"),
    pytest.param(F32, 59, 4, 16, 97, None, False, id="noncausal-f32-d59-g4"),
    pytest.param(F16, 64, 8, 16, 60, 100, True, id="offset-past-kv-f16-d64-g8"),
    pytest.param(BF16, 64, 1, 8, 24, -4, True, id="negative-offset-bf16-d64-g1"),
    pytest.param(F16, 64, 1, 1, 1025, None, True, id="kv1025-f16-d64-g1"),
]


@pytest.mark.parametrize(
    ("dtype", "head_dim", "group", "num_q", "num_kv", "q_offset", "causal"), CHUNKED_CASES
)
def test_chunked_prefill_matches_reference(dtype, head_dim, group, num_q, num_kv, q_offset, causal):
    num_kv_heads = 2 if num_kv < 1000 else 1
    q = _randn(num_q, group * num_kv_heads, head_dim, dtype=dtype)
    k = _randn(num_kv, num_kv_heads, head_dim, dtype=dtype)
    v = _randn(num_kv, num_kv_heads, head_dim, dtype=dtype)
    o, lse = chunked_prefill_attention(q, k, v, q_offset=q_offset, causal=causal, backend="triton")
    _check_attention(o, lse, q, k, v, q_offset=q_offset, causal=causal)
    if q_offset is not None and q_offset < 0:
        assert torch.isinf(lse[:-q_offset]).all()  # queries before key 0 see nothing


def test_chunked_prefill_strided_views_and_sm_scale():
    """q/k/v sliced out of one packed qkv tensor (non-contiguous), custom sm_scale."""
    num_q, num_kv, heads, kv_heads, d = 24, 40, 4, 1, 64
    qkv = _randn(num_kv, heads + 2 * kv_heads, d + 8)
    q = qkv[-num_q:, :heads, :d]
    k = qkv[:, heads : heads + kv_heads, :d]
    v = qkv[:, heads + kv_heads :, 4 : d + 4]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    o, lse = chunked_prefill_attention(q, k, v, sm_scale=0.3, backend="triton")
    _check_attention(o, lse, q, k, v, sm_scale=0.3)


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_prefill_without_keys_gives_empty_state(causal):
    q = _randn(5, 4, 64)
    k = v = _randn(0, 2, 64)
    o, lse = chunked_prefill_attention(q, k, v, causal=causal, backend="triton")
    assert torch.equal(o, torch.zeros_like(q))
    assert torch.equal(lse, torch.full((5, 4), -INF, device=DEVICE))


# --- KV parallelism: sharded partials merged exactly ------------------------------------


@pytest.mark.parametrize(
    ("dtype", "num_kv", "q_offset", "bounds"),
    [
        pytest.param(F32, 200, 184, (70, 140), id="3-shards-end-chunk-f32"),
        pytest.param(BF16, 200, 50, (40,), id="2-shards-mid-chunk-bf16"),
        pytest.param(F16, 97, 0, (), id="1-shard-start-chunk-f16"),
    ],
)
def test_kv_parallel_shards_merge_to_unsharded(dtype, num_kv, q_offset, bounds):
    """Shards before the chunk non-causal, the last (holding the chunk) causal; merged == whole."""
    num_q, heads, kv_heads, d = 16, 8, 2, 64
    q = _randn(num_q, heads, d, dtype=dtype)
    k = _randn(num_kv, kv_heads, d, dtype=dtype)
    v = _randn(num_kv, kv_heads, d, dtype=dtype)
    edges = [0, *bounds]
    assert edges[-1] <= q_offset  # every earlier shard lies wholly before the chunk
    outs, lses = [], []
    for lo, hi in itertools.pairwise(edges):
        o, s = chunked_prefill_attention(q, k[lo:hi], v[lo:hi], causal=False, backend="triton")
        outs.append(o)
        lses.append(s)
    last = edges[-1]
    o, s = chunked_prefill_attention(
        q, k[last:], v[last:], q_offset=q_offset - last, backend="triton"
    )
    outs.append(o)
    lses.append(s)
    merged_o, merged_s = merge_states(
        torch.stack(outs, dim=1), torch.stack(lses, dim=1), backend="triton"
    )
    whole_o, whole_s = chunked_prefill_attention(q, k, v, q_offset=q_offset, backend="triton")
    _check_attention(merged_o, merged_s, q, k, v, q_offset=q_offset)
    _check_attention(whole_o, whole_s, q, k, v, q_offset=q_offset)
    tol = 1e-5 if dtype == F32 else 2e-2
    torch.testing.assert_close(merged_o.float(), whole_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(merged_s, whole_s, atol=1e-5, rtol=1e-5)


# --- paged attention ---------------------------------------------------------------------


def _paged_batch(dtype, head_dim, group, num_qs, kv_lens, block_size=16, kv_heads=2):
    """A shuffled paged cache (unused slots hold NaN) and its batch index tensors."""
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE).to(dtype)
    v_cache = torch.full(shape, float("nan"), device=DEVICE).to(dtype)
    perm = torch.randperm(num_blocks).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    start = 0
    for b, (n, length) in enumerate(zip(need, kv_lens, strict=True)):
        table[b, :n] = perm[start : start + n]
        start += n
        for j in range(length):
            blk, pos = table[b, j // block_size], j % block_size
            k_cache[blk, pos] = _randn(kv_heads, head_dim, dtype=dtype)
            v_cache[blk, pos] = _randn(kv_heads, head_dim, dtype=dtype)
    assert not torch.equal(table[table >= 0].sort().values, table[table >= 0])  # shuffled
    cu = torch.tensor([0, *torch.tensor(num_qs).cumsum(0).tolist()], dtype=torch.int32)
    q = _randn(int(cu[-1]), kv_heads * group, head_dim, dtype=dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    return q, k_cache, v_cache, cu.to(DEVICE), lens.to(DEVICE), table.to(DEVICE)


def _check_paged(o, lse, q, k_cache, v_cache, cu, lens, table, causal=True):
    assert not torch.isnan(o).any()
    for b, length in enumerate(lens.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        k = paged_to_dense(k_cache, table[b], length)
        v = paged_to_dense(v_cache, table[b], length)
        _check_attention(o[lo:hi], lse[lo:hi], q[lo:hi], k, v, causal=causal)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "group", "causal"),
    [
        pytest.param(F32, 64, 1, True, id="f32-d64-g1"),
        pytest.param(BF16, 128, 4, True, id="bf16-d128-g4"),
        pytest.param(F16, 59, 8, True, id="f16-d59-g8"),
        pytest.param(BF16, 40, 4, False, id="noncausal-bf16-d40-g4"),
    ],
)
def test_paged_mixed_batch(dtype, head_dim, group, causal):
    """A long decode (split-KV), a prefill chunk, a full prefill, a 1-key decode, an idle
    sequence and a 2-query chunk."""
    num_qs = [1, 16, 33, 1, 0, 2]
    kv_lens = [300, 97, 33, 1, 5, 9]
    batch = _paged_batch(dtype, head_dim, group, num_qs, kv_lens)
    q, k_cache, v_cache, cu, lens, table = batch
    o, lse = paged_attention(
        q, k_cache, v_cache, cu_seqlens_q=cu, kv_lens=lens, block_table=table,
        causal=causal, backend="triton",
    )  # fmt: skip
    _check_paged(o, lse, *batch, causal=causal)


def test_decode_split_kv_rule_and_empty_splits(monkeypatch):
    """Several splits per decode (some beyond the keys: empty), equal to no splitting."""
    from medha_kernels.triton import attention as tri_attn

    def cdiv(a: int, b: int) -> int:
        return -(a // -b)

    def splits(kv_len: int) -> int:  # the in-kernel rule, as documented
        n = max(1, min(tri_attn.MAX_SPLITS, cdiv(kv_len, tri_attn.SPLIT_MIN_KV)))
        size = cdiv(cdiv(kv_len, n), 64) * 64  # BLOCK_N = 64 for head_dim <= 128
        return cdiv(kv_len, size)

    assert splits(300) == 3 and splits(2049) == 11 and splits(1) == 1
    batch = _paged_batch(BF16, 64, 4, [1, 1, 1], [300, 2049, 129], kv_heads=1)
    q, k_cache, v_cache, cu, lens, table = batch
    kw = {"cu_seqlens_q": cu, "kv_lens": lens, "block_table": table, "backend": "triton"}
    o, lse = paged_attention(q, k_cache, v_cache, **kw)
    _check_paged(o, lse, *batch)
    monkeypatch.setattr(tri_attn, "MAX_SPLITS", 1)
    o1, lse1 = paged_attention(q, k_cache, v_cache, **kw)
    torch.testing.assert_close(o.float(), o1.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_qs", "kv_lens"),
    [
        pytest.param([1, 16, 33, 1, 0, 2], [300, 97, 33, 1, 5, 9], id="mixed"),
        pytest.param([1, 1, 1], [3000, 7, 129], id="decodes-only"),
        pytest.param([16, 3], [200, 3], id="prefills-only"),
    ],
)
def test_planned_paged_attention_sizes_launches_to_the_step(num_qs, kv_lens):
    """A plan leaves out the launch its step does not need and gives a long decode more
    splits than the unplanned ``MAX_SPLITS``; results match the float64 truth."""
    from medha_kernels import plan_paged_attention
    from medha_kernels.triton import attention as tri_attn

    batch = _paged_batch(BF16, 64, 4, num_qs, kv_lens, kv_heads=1)
    q, k_cache, v_cache, cu, lens, table = batch
    plan = plan_paged_attention(
        cu_seqlens_q=cu, kv_lens=lens, block_table=table, num_qo_heads=4, num_kv_heads=1,
        head_dim=64, block_size=16, dtype=BF16, backend="triton",
    )  # fmt: skip
    assert plan.backend == "triton"
    o, lse = plan.run(q, k_cache, v_cache)
    _check_paged(o, lse, *batch)
    decodes = [n_kv for n, n_kv in zip(num_qs, kv_lens, strict=True) if n == 1]
    if decodes:
        splits = tri_attn.decode_splits(max(decodes), len(decodes), q.device, BF16)
        per_sm = tri_attn.tile_config("decode", q.device, BF16)["programs_per_sm"]
        target = tri_attn._target_programs(q.device, per_sm)  # 64 on the CPU; SMs x 8 on a GPU
        want = min(-(-target // len(decodes)), -(-max(decodes) // tri_attn.SPLIT_MIN_KV))
        assert splits == want
    if max(kv_lens) == 3000:  # 24 splits of 128 keys, more than the unplanned 16
        assert tri_attn.decode_splits(3000, 1, q.device, BF16) == 24 > tri_attn.MAX_SPLITS


@pytest.mark.parametrize("causal", [True, False])
def test_planned_prefill_splits_the_keys_of_a_short_chunk(monkeypatch, causal):
    """A short chunk over a long context has one query tile per KV head: a plan splits
    its keys over several programs (merged after), and the step still matches the
    float64 truth, beside a decode, a whole prefill and a chunk that ends mid-tile;
    without splits (``MAX_PREFILL_SPLITS = 1``) the result is the same."""
    from types import SimpleNamespace

    from medha_kernels import plan_paged_attention
    from medha_kernels.triton import attention as tri_attn

    num_qs, kv_lens = [5, 1, 33, 3], [700, 300, 33, 260]
    batch = _paged_batch(BF16, 64, 4, num_qs, kv_lens, kv_heads=1)
    q, k_cache, v_cache, cu, lens, table = batch
    kw = {
        "cu_seqlens_q": cu, "kv_lens": lens, "block_table": table, "num_qo_heads": 4,
        "num_kv_heads": 1, "head_dim": 64, "block_size": 16, "dtype": BF16,
        "backend": "triton", "causal": causal,
    }  # fmt: skip
    meta = SimpleNamespace(
        query_counts=num_qs, lens=kv_lens, num_kv_heads=1, num_qo_heads=4, head_dim=64,
        num_q=sum(num_qs), device=q.device,
    )  # fmt: skip
    tiles = tri_attn._tiles(4, 64, q.device, BF16)
    # 4 tiles of 16 queries (5, 33 in 3, 3) x 1 KV head; 700 keys in splits of >= 128
    target = tri_attn._target_programs(q.device)
    assert tri_attn.prefill_splits(meta, tiles) == min(6, -(-target // 4)) > 1
    o, lse = plan_paged_attention(**kw).run(q, k_cache, v_cache)
    _check_paged(o, lse, *batch, causal=causal)
    monkeypatch.setattr(tri_attn, "MAX_PREFILL_SPLITS", 1)
    assert tri_attn.prefill_splits(meta, tiles) == 1
    o1, lse1 = plan_paged_attention(**kw).run(q, k_cache, v_cache)
    torch.testing.assert_close(o.float(), o1.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse1, atol=1e-5, rtol=1e-5)
    # the partials of every row stay within PREFILL_PARTIALS_BYTES
    monkeypatch.setattr(tri_attn, "MAX_PREFILL_SPLITS", 64)
    monkeypatch.setattr(tri_attn, "PREFILL_PARTIALS_BYTES", 3 * sum(num_qs) * 4 * 65 * 4)
    assert tri_attn.prefill_splits(meta, tiles) == 3
    # query tiles that fill half the device already: no split
    many = SimpleNamespace(**{**vars(meta), "query_counts": [16] * (target // 2 + 1)})
    many.lens, many.num_q = [700] * len(many.query_counts), 16 * len(many.query_counts)
    assert tri_attn.prefill_splits(many, tiles) == 1


def test_decode_plan_sized_for_longer_rows_than_the_step():
    """A CUDA graph's decode plan is built once for the longest row possible; a step of
    shorter rows then runs with more splits than it needs (those past each row's keys
    are empty), and still matches the float64 truth."""
    from medha_kernels import plan_paged_attention
    from medha_kernels.plan import PagedHost
    from medha_kernels.triton import attention as tri_attn

    batch = _paged_batch(BF16, 64, 4, [1, 1, 1], [300, 7, 129], kv_heads=1)
    q, k_cache, v_cache, cu, lens, table = batch
    longest = 4096  # the table as wide as the longest row: padded with block 0
    table = torch.nn.functional.pad(table, (0, longest // 16 - table.shape[1]))
    batch = (q, k_cache, v_cache, cu, lens, table)
    last = k_cache.shape[0] - 1
    host = PagedHost(cu_seqlens_q=[0, 1, 2, 3], kv_lens=[longest] * 3, max_block=last)
    plan = plan_paged_attention(
        cu_seqlens_q=cu, kv_lens=lens, block_table=table, num_qo_heads=4, num_kv_heads=1,
        head_dim=64, block_size=16, dtype=BF16, backend="triton", host=host,
    )  # fmt: skip
    wide = tri_attn.decode_splits(longest, 3, q.device, BF16)
    assert wide > tri_attn.decode_splits(300, 3, q.device, BF16)
    o, lse = plan.run(q, k_cache, v_cache)
    _check_paged(o, lse, *batch)


# --- merge ------------------------------------------------------------------------------


def _edge_states(num_tokens, heads, d, dtype):
    """Two random states with edge rows: token 0 a empty (-inf), 1 a +inf, 2 a NaN (garbage
    v), 3 both empty, 4 b empty, 5 a tie at +1e4, 6 both near -1e4."""
    v_a, v_b = _randn(num_tokens, heads, d, dtype=dtype), _randn(num_tokens, heads, d, dtype=dtype)
    s_a, s_b = _randn(num_tokens, heads) * 3, _randn(num_tokens, heads) * 3
    s_a[0], s_a[1], s_a[2] = -INF, INF, float("nan")
    v_a[0], v_a[1], v_a[2] = INF, float("nan"), -INF  # garbage that must not leak
    s_a[3], s_b[3] = -INF, INF
    v_a[3], v_b[3] = float("nan"), 1e4
    s_b[4], v_b[4] = float("nan"), float("nan")
    s_a[5], s_b[5] = 1e4, 1e4
    s_a[6], s_b[6] = -1e4 + 1.5, -1e4 - 0.5
    return v_a, s_a, v_b, s_b


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(F32, 64), (BF16, 128), (F16, 40)], ids=["f32-64", "bf16-128", "f16-40"]
)
def test_merge_state_edge_cases(dtype, head_dim):
    v_a, s_a, v_b, s_b = _edge_states(24, 4, head_dim, dtype)
    v, s = merge_state(v_a, s_a, v_b, s_b, backend="triton")
    both_v, both_s = torch.stack((v_a, v_b), 1), torch.stack((s_a, s_b), 1)
    v_true, s_true = merge_ref(both_v, both_s)
    v_base, s_base = merge_ref(both_v, both_s, upcast=False)
    assert_twice_torch(v, v_true, v_base, what="v")
    assert_twice_torch(s, s_true, s_base, what="s")
    for row in (0, 1, 2):  # a empty: exactly b
        assert torch.equal(v[row], v_b[row]) and torch.equal(s[row], s_b[row])
    assert torch.equal(v[4], v_a[4]) and torch.equal(s[4], s_a[4])  # b empty: exactly a
    assert torch.all(v[3] == 0) and torch.all(s[3] == -INF)  # both empty
    expected_tie = ((v_a[5].double() + v_b[5].double()) / 2).to(dtype)  # weights exactly 1/2
    assert torch.equal(v[5], expected_tie)
    assert torch.isfinite(s[5:7]).all()
    torch.testing.assert_close(s[6], torch.logaddexp(s_a[6], s_b[6]))


def test_merge_state_strided_inputs():
    """vLLM-style head-major LSE views and a v sliced from a wider tensor."""
    v_a_wide, v_b = _randn(9, 3, 80), _randn(9, 3, 64)
    v_a = v_a_wide[:, :, 8:72]
    s_a, s_b = _randn(3, 9).T, _randn(3, 9).T
    v, s = merge_state(v_a, s_a, v_b, s_b, backend="triton")
    v_ref, s_ref = merge_state(v_a, s_a, v_b, s_b, backend="torch")
    torch.testing.assert_close(v, v_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_merge_state_in_place_masks(dtype):
    v_a, s_a, v_b, s_b = _edge_states(20, 4, 64, dtype)
    v_full, s_full = merge_state(v_a, s_a, v_b, s_b, backend="triton")

    v, s = v_a.clone(), s_a.clone()
    merge_state_in_place(v, s, v_b, s_b, backend="triton")
    assert torch.equal(v, v_full) and torch.equal(s, s_full)

    v, s = v_a.clone(), s_a.clone()
    off = torch.zeros(20, dtype=torch.bool, device=DEVICE)  # the mask lives with the states
    merge_state_in_place(v, s, v_b, s_b, mask=off, backend="triton")
    assert torch.equal(v.view(torch.uint8), v_a.view(torch.uint8))  # bit-identical, NaN too
    assert torch.equal(s.view(torch.uint8), s_a.view(torch.uint8))

    mask = torch.rand(20, device=DEVICE) > 0.5
    mask[:3] = torch.tensor([True, False, True])
    v, s = v_a.clone(), s_a.clone()
    merge_state_in_place(v, s, v_b, s_b, mask=mask, backend="triton")
    assert torch.equal(v[~mask].view(torch.uint8), v_a[~mask].view(torch.uint8))
    assert torch.equal(s[~mask].view(torch.uint8), s_a[~mask].view(torch.uint8))
    assert torch.equal(v[mask], v_full[mask]) and torch.equal(s[mask], s_full[mask])
    assert not torch.equal(v[mask], v_a[mask])


@pytest.mark.parametrize(
    ("dtype", "head_dim", "num_states"),
    [(F32, 64, 0), (BF16, 128, 1), (F16, 40, 3), (F32, 59, 7)],
)
def test_merge_states(dtype, head_dim, num_states):
    tokens, heads = 12, 3
    v = _randn(tokens, num_states, heads, head_dim, dtype=dtype)
    s = _randn(tokens, num_states, heads) * 4
    if num_states:
        s[0] = -INF  # all empty
        s[1, 0], v[1, 0] = INF, float("nan")
        s[2, -1], v[2, -1] = float("nan"), INF
        s[3] += 1e4
        s[4] -= 1e4
    out, lse = merge_states(v, s, backend="triton")
    assert out.shape == (tokens, heads, head_dim) and out.dtype == dtype
    if num_states == 0:
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.full((tokens, heads), -INF, device=DEVICE))
        return
    v_true, s_true = merge_ref(v, s)
    v_base, s_base = merge_ref(v, s, upcast=False)
    assert_twice_torch(out, v_true, v_base, what="v")
    assert_twice_torch(lse, s_true, s_base, what="s")
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -INF)
    if num_states == 1:  # a copy where the LSE is finite, empty elsewhere
        finite = torch.isfinite(s[:, 0])
        assert torch.equal(out[finite], v[:, 0][finite])
        assert torch.equal(lse[finite], s[:, 0][finite])
        assert torch.all(lse[~finite] == -INF) and torch.all(out[~finite] == 0)


@pytest.mark.parametrize(("dtype", "num_states"), [(F32, 70), (BF16, 33), (F16, 129)])
def test_merge_states_across_read_blocks(dtype, num_states):
    """More states than one read block (32): empties, maxima and NaNs in later blocks."""
    tokens, heads, head_dim = 6, 5, 72
    v = _randn(tokens, num_states, heads, head_dim, dtype=dtype)
    s = _randn(tokens, num_states, heads) * 4
    s[0] = -INF  # all empty
    s[1, :32] = -INF  # the first block empty, the rest not
    s[2, -1] += 60.0  # the maximum in the last block: earlier sums rescaled
    s[3, 32, 1], v[3, 32, 1] = float("nan"), INF  # NaN counts as empty
    s[4, 2:] = -INF  # only the first block holds anything
    s[5, :-1] = -INF  # only the very last state
    out, lse = merge_states(v, s, backend="triton")
    v_true, s_true = merge_ref(v, s)
    v_base, s_base = merge_ref(v, s, upcast=False)
    assert_twice_torch(out, v_true, v_base, what="v")
    assert_twice_torch(lse, s_true, s_base, what="s")
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -INF)
    assert torch.equal(out[5], v[5, -1]) and torch.equal(lse[5], s[5, -1])


# --- append_paged_kv ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst"), [(F32, F32), (BF16, BF16), (F16, F16), (F32, BF16), (F16, BF16)]
)
def test_append_paged_kv_bit_exact_with_torch(src, dst):
    tokens, heads, d, blocks, block_size = 13, 2, 40, 6, 4
    k_wide = torch.randn(tokens, heads, d + 3, device=DEVICE) * 100
    k = k_wide[:, :, 1 : d + 1].to(src)  # strided when src is fp32
    v = (torch.randn(tokens, heads, d, device=DEVICE) * 100).to(src)
    slots = torch.randperm(blocks * block_size, device=DEVICE)[:tokens].to(torch.int32)
    slots[[2, 7]] = -1  # padding: skipped
    k_cache = torch.randn(blocks, block_size, heads, d, device=DEVICE).to(dst)
    v_cache = torch.randn(blocks, block_size, heads, d, device=DEVICE).to(dst)
    caches = (k_cache.clone(), v_cache.clone())
    append_paged_kv(k, v, k_cache, v_cache, slots=slots, backend="triton")
    append_paged_kv(k, v, *caches, slots=slots, backend="torch")
    assert torch.equal(k_cache.view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), caches[1].view(torch.uint8))
    written = slots[slots >= 0].long()
    assert torch.equal(k_cache.view(-1, heads, d)[written], k[slots >= 0].to(dst))
