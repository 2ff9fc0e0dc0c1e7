"""The torch backend against the float64 truth, and the semantics every backend shares."""

from __future__ import annotations

import math

import pytest
import torch

from medha_kernels import (
    append_paged_kv,
    chunked_prefill_attention,
    merge_state,
    merge_state_in_place,
    merge_states,
    paged_attention,
)

from .reference import assert_twice_torch, attention_ref, merge_ref, paged_to_dense

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B = "torch"


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def check_attention(q, k, v, *, q_offset=None, causal=True, backend=B) -> None:
    o, lse = chunked_prefill_attention(q, k, v, q_offset=q_offset, causal=causal, backend=backend)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert o.shape == q.shape and lse.shape == q.shape[:2]
    o64, lse64 = attention_ref(q, k, v, q_offset=q_offset, causal=causal, upcast=True)
    o_pt, lse_pt = attention_ref(q, k, v, q_offset=q_offset, causal=causal, upcast=False)
    assert_twice_torch(o, o64, o_pt, what="o")
    assert_twice_torch(lse, lse64, lse_pt, what="lse")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_q", "num_kv", "heads", "head_dim"),
    [(1, 1, (4, 4), 64), (97, 97, (8, 2), 128), (13, 1025, (8, 1), 59), (33, 200, (4, 1), 64)],
)
def test_chunked_prefill_matches_float64(dtype, num_q, num_kv, heads, head_dim) -> None:
    hq, hk = heads
    check_attention(
        rand(num_q, hq, head_dim, dtype=dtype),
        rand(num_kv, hk, head_dim, dtype=dtype),
        rand(num_kv, hk, head_dim, dtype=dtype),
    )


@pytest.mark.parametrize("where", ["start", "middle", "end"])
@pytest.mark.parametrize("causal", [True, False])
def test_chunk_position_in_the_sequence(where, causal) -> None:
    num_kv, c = 300, 40
    offset = {"start": 0, "middle": 130, "end": num_kv - c}[where]
    q, k, v = rand(c, 8, 64), rand(num_kv, 2, 64), rand(num_kv, 2, 64)
    check_attention(q, k, v, q_offset=offset, causal=causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("offset", [0, 57, 250])
def test_query_and_key_tiles(monkeypatch, causal, offset) -> None:
    # Small tiles so that several query tiles, key tiles, and (causal) skipped
    # key tiles are all exercised with odd sizes.
    from medha_kernels.torch_ref import attention as ref_attention

    monkeypatch.setattr(ref_attention, "Q_TILE", 23)
    monkeypatch.setattr(ref_attention, "KV_TILE", 37)
    num_q = 101
    q, k, v = rand(num_q, 4, 32), rand(offset + num_q, 2, 32), rand(offset + num_q, 2, 32)
    check_attention(q, k, v, q_offset=offset, causal=causal)


def test_key_tiles_shrink_as_queries_grow() -> None:
    from medha_kernels.torch_ref.attention import KV_TILE, MIN_KV_TILE, SCORE_TILE, kv_tile

    assert kv_tile(1, 4) == KV_TILE  # a decode row takes the widest tile
    assert kv_tile(512, 4) == SCORE_TILE // (512 * 4)
    assert kv_tile(1 << 20, 64) == MIN_KV_TILE  # never below the floor
    sizes = [kv_tile(n, 8) for n in (1, 7, 64, 300, 1024)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) > 2


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("offset", [74, 89])
def test_adaptive_key_tiles_match_the_reference(monkeypatch, causal, offset) -> None:
    # A small score budget: 101 queries x 4 heads get 19-key tiles (odd sizes,
    # some tiles wholly visible and unmasked, some cut by the causal edge).
    # With offset 74 the tile [57, 75] ends one key past what row 0 may see,
    # so it alone must be masked.
    from medha_kernels.torch_ref import attention as ref_attention

    monkeypatch.setattr(ref_attention, "SCORE_TILE", 101 * 4 * 19)
    monkeypatch.setattr(ref_attention, "MIN_KV_TILE", 5)
    assert ref_attention.kv_tile(101, 4) == 19
    q, k, v = rand(101, 4, 32), rand(offset + 101, 2, 32), rand(offset + 101, 2, 32)
    check_attention(q, k, v, q_offset=offset, causal=causal)


def test_rows_that_see_no_key_are_empty_states() -> None:
    q, k, v = rand(4, 2, 16), rand(6, 2, 16), rand(6, 2, 16)
    o, lse = chunked_prefill_attention(q, k, v, q_offset=-2, backend=B)
    assert torch.isinf(lse[:2]).all() and (lse[:2] < 0).all()
    assert (o[:2] == 0).all() and not torch.isnan(o).any()
    assert torch.isfinite(lse[2:]).all()
    o, lse = chunked_prefill_attention(q, k[:0], v[:0], q_offset=0, causal=False, backend=B)
    assert (o == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvp_identity_sharded_partials_merge_to_the_whole(shards, dtype) -> None:
    num_kv, c = 257, 31
    q, k, v = (
        rand(c, 8, 64, dtype=dtype),
        rand(num_kv, 2, 64, dtype=dtype),
        rand(num_kv, 2, 64, dtype=dtype),
    )
    cuts = [round(i * num_kv / shards) for i in range(shards + 1)]
    parts_o, parts_s = [], []
    for i in range(shards):
        lo, hi = cuts[i], cuts[i + 1]
        last = i == shards - 1
        # earlier shards lie wholly before the chunk: non-causal; the tail is causal.
        o, s = chunked_prefill_attention(
            q, k[lo:hi], v[lo:hi], q_offset=(num_kv - c) - lo, causal=last, backend=B
        )
        parts_o.append(o)
        parts_s.append(s)
    o, s = merge_states(torch.stack(parts_o, 1), torch.stack(parts_s, 1), backend=B)
    _, whole_s = chunked_prefill_attention(q, k, v, backend=B)
    o64, s64 = attention_ref(q, k, v, upcast=True)
    o_pt, s_pt = attention_ref(q, k, v, upcast=False)
    assert_twice_torch(o, o64, o_pt)
    assert torch.allclose(s, whole_s, atol=1e-4)
    assert_twice_torch(s, s64, s_pt, what="lse")


def paged_batch(dtype=torch.float32, *, block_size=16, heads=(8, 2), head_dim=64):
    """A mixed batch: a decode, a prefill chunk, a whole prefill; shuffled blocks."""
    hq, hk = heads
    q_lens, kv_lens = [1, 20, 37], [50, 90, 37]
    blocks_needed = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(blocks_needed), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_needed):
        table[b, :n] = perm[used : used + n]
        used += n
    k_cache = rand(num_blocks, block_size, hk, head_dim, dtype=dtype)
    v_cache = rand(num_blocks, block_size, hk, head_dim, dtype=dtype)
    q = rand(sum(q_lens), hq, head_dim, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), table


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_mixed_batch_with_shuffled_blocks(dtype) -> None:
    q, kc, vc, cu, lens, table = paged_batch(dtype)
    o, lse = paged_attention(q, kc, vc, cu_seqlens_q=cu, kv_lens=lens, block_table=table, backend=B)
    for b in range(len(lens)):
        lo, hi = cu[b].item(), cu[b + 1].item()
        k = paged_to_dense(kc, table[b], lens[b].item())
        v = paged_to_dense(vc, table[b], lens[b].item())
        o64, s64 = attention_ref(q[lo:hi], k, v, upcast=True)
        o_pt, s_pt = attention_ref(q[lo:hi], k, v, upcast=False)
        assert_twice_torch(o[lo:hi], o64, o_pt, what=f"o[{b}]")
        assert_twice_torch(lse[lo:hi], s64, s_pt, what=f"lse[{b}]")


def test_append_paged_kv_writes_slots_and_skips_negative() -> None:
    kc, vc = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    k, v = rand(3, 2, 16), rand(3, 2, 16)
    slots = torch.tensor([17, -1, 3], dtype=torch.int32)
    append_paged_kv(k, v, kc, vc, slots=slots, backend=B)
    assert torch.equal(kc[2, 1], k[0]) and torch.equal(vc[0, 3], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # the padded token wrote nothing


@pytest.mark.parametrize("backend", [B, "auto"])
def test_append_paged_kv_into_views_of_one_kv_cache(backend) -> None:
    """FlashInfer's ``[num_pages, 2, page_size, heads, dim]`` cache gives K and V as
    non-contiguous views (which paged attention reads); appending to them raised
    torch's "view size is not compatible" RuntimeError. The writes land in the cache."""
    cache = torch.zeros(4, 2, 8, 2, 16)
    kc, vc = cache[:, 0], cache[:, 1]
    k, v = rand(3, 2, 16), rand(3, 2, 16)
    append_paged_kv(
        k, v, kc, vc, slots=torch.tensor([17, -1, 31], dtype=torch.int32), backend=backend
    )
    assert torch.equal(cache[2, 0, 1], k[0]) and torch.equal(cache[3, 1, 7], v[2])
    assert int((cache != 0).any(-1).any(-1).sum()) == 4  # two tokens' K and V, nothing else


# ------------------------------------------------------------------ merges
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "h", "d"), [(1, 1, 64), (97, 32, 128), (1025, 4, 59)])
def test_merge_state_matches_float64(dtype, t, h, d) -> None:
    va, vb = rand(t, h, d, dtype=dtype), rand(t, h, d, dtype=dtype)
    sa, sb = rand(t, h) * 3, rand(t, h) * 3
    v, s = merge_state(va, sa, vb, sb, backend=B)
    assert v.dtype == dtype and s.dtype == torch.float32
    stack_v, stack_s = torch.stack((va, vb), 1), torch.stack((sa, sb), 1)
    v64, s64 = merge_ref(stack_v, stack_s)
    v_pt, s_pt = merge_ref(stack_v, stack_s, upcast=False)
    assert_twice_torch(v, v64, v_pt)
    assert_twice_torch(s, s64, s_pt, what="lse")


def test_merge_edge_cases_empty_garbage_and_offsets() -> None:
    t, h, d = 6, 2, 8
    va, vb = rand(t, h, d), rand(t, h, d)
    sa, sb = rand(t, h), rand(t, h)
    va[0], sa[0] = float("nan"), float("-inf")  # empty with garbage v
    va[1], sa[1] = 1e30, float("inf")  # +inf counts as empty
    va[2], sa[2] = float("nan"), float("nan")  # NaN counts as empty
    sa[3], sb[3] = float("-inf"), float("-inf")  # both empty
    va[3], vb[3] = float("nan"), float("nan")
    sa[4], sb[4] = 1e4, 1e4  # large common offset, tie
    sa[5], sb[5] = -1e30, -1e30 + 1  # very negative but finite: not empty
    v, s = merge_state(va, sa, vb, sb, backend=B)
    assert not torch.isnan(v).any() and not torch.isnan(s).any()
    for row in (0, 1, 2):
        assert torch.allclose(v[row], vb[row]) and torch.allclose(s[row], sb[row])
    assert (v[3] == 0).all() and torch.isneginf(s[3]).all()
    assert torch.allclose(v[4], (va[4] + vb[4]) / 2)
    assert torch.allclose(s[4], torch.full((h,), 1e4 + math.log(2)))
    assert torch.isfinite(s[5]).all()


def test_merge_states_zero_one_and_many() -> None:
    v, s = rand(5, 0, 2, 8), rand(5, 0, 2)
    out_v, out_s = merge_states(v, s, backend=B)
    assert (out_v == 0).all() and torch.isneginf(out_s).all()
    v, s = rand(5, 1, 2, 8), rand(5, 1, 2)
    out_v, out_s = merge_states(v, s, backend=B)
    assert torch.allclose(out_v, v[:, 0]) and torch.allclose(out_s, s[:, 0])
    v, s = rand(5, 7, 2, 8), rand(5, 7, 2) + 1e4
    out_v, out_s = merge_states(v, s, backend=B)
    v64, s64 = merge_ref(v, s)
    assert torch.allclose(out_v.double(), v64, atol=1e-5)
    assert torch.allclose(out_s.double(), s64, rtol=0, atol=1e-3)


def test_merge_in_place_mask_leaves_rows_bit_identical() -> None:
    v, s, vo, so = rand(9, 2, 8), rand(9, 2), rand(9, 2, 8), rand(9, 2)
    mask = torch.tensor([True, False] * 4 + [False])
    v_before, s_before = v.clone(), s.clone()
    expected_v, expected_s = merge_state(v, s, vo, so, backend=B)
    merge_state_in_place(v, s, vo, so, mask=mask, backend=B)
    assert torch.equal(v[~mask], v_before[~mask]) and torch.equal(s[~mask], s_before[~mask])
    assert torch.allclose(v[mask], expected_v[mask]) and torch.allclose(s[mask], expected_s[mask])
    merge_state_in_place(v, s, vo, so, mask=torch.zeros(9, dtype=torch.bool), backend=B)
    assert torch.equal(v[~mask], v_before[~mask])
