"""The flashinfer backend.

CPU tests (always run): device support, the pure helpers (LSE base
conversion, block table -> CSR, q_offset -> bottom-right calls), the limits,
and the adapter's plumbing against a torch stand-in for flashinfer that
follows its documented conventions (base-2 LSE, bottom-right causal mask,
CSR pages, NaN for empty merges as in older releases).

GPU tests (class ``TestOnGPU``) need CUDA and an importable flashinfer; they
compare the real kernels with the float64 reference.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from medha_kernels import (
    available_backends,
    chunked_prefill_attention,
    merge_state,
    merge_state_in_place,
    merge_states,
    paged_attention,
)
from medha_kernels.flashinfer_adapter import FlashInferLimitError, can_run, ops, supports_device
from medha_kernels.flashinfer_adapter.convert import (
    build_paged_index,
    fix_empty_merge,
    lse_from_base2,
    lse_to_base2,
    prefill_calls,
)

from .reference import assert_twice_torch, attention_ref, merge_ref, paged_to_dense

_MISSING = [
    what
    for what, ok in (
        ("a CUDA device", torch.cuda.is_available()),
        ("flashinfer (pip install flashinfer-python)", ops.load() is not None),
    )
    if not ok
]
needs_flashinfer = pytest.mark.skipif(
    bool(_MISSING), reason="flashinfer GPU tests need " + " and ".join(_MISSING)
)
INF, NAN = float("inf"), float("nan")


def rand(*shape: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


# --------------------------------------------------------------------------- CPU: no flashinfer


def test_cpu_is_not_supported() -> None:
    assert supports_device(torch.device("cpu")) is False
    assert "flashinfer" not in available_backends("cpu")
    if _MISSING:
        assert "flashinfer" not in available_backends()


def test_lse_base_conversion() -> None:
    x = torch.tensor([0.0, 1.0, -3.5, 1e4, -1e30])
    assert torch.allclose(lse_to_base2(x), x / math.log(2), rtol=1e-6)
    assert torch.allclose(lse_from_base2(lse_to_base2(x)), x, rtol=1e-6)
    # log2-sum-exp2 of base-2 scores is the natural LSE in base 2
    scores = torch.randn(5, 7, dtype=torch.float64)
    base2 = torch.log2(torch.exp2(scores * math.log2(math.e)).sum(-1))
    assert torch.allclose(lse_to_base2(torch.logsumexp(scores, -1)).double(), base2, atol=1e-5)
    odd = torch.tensor([INF, -INF, NAN])
    for convert in (lse_to_base2, lse_from_base2):
        out = convert(odd)
        assert out.dtype == torch.float32 and torch.isneginf(out).all()


def test_paged_index_from_a_shuffled_block_table() -> None:
    table = torch.tensor(
        [[7, 2, 9, 0], [4, 1, 0, 0], [5, 3, 8, 6], [11, 0, 0, 0]], dtype=torch.int32
    )
    cu = [0, 5, 6, 6, 7]  # sequence 2 has no query: dropped
    index = build_paged_index(cu, [40, 32, 60, 1], table, block_size=16)
    assert index.qo_indptr.tolist() == [0, 5, 6, 7]
    assert index.kv_indptr.tolist() == [0, 3, 5, 6]
    assert index.kv_indices.tolist() == [7, 2, 9, 4, 1, 11]
    assert index.kv_last_page_len.tolist() == [8, 16, 1]
    for t in index:
        assert t.dtype == torch.int32
    assert index.qo_indptr.device.type == "cpu"
    none = build_paged_index([0, 0], [0], table[:1], block_size=16)
    assert none.kv_indices.numel() == 0 and none.qo_indptr.tolist() == [0]


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_calls_reproduce_the_mask(causal: bool) -> None:
    for num_q in (0, 1, 4, 9):
        for num_kv in (0, 1, 5, 12):
            for q_offset in range(-12, 16):
                want = torch.zeros(num_q, num_kv, dtype=torch.bool)
                for i in range(num_q):
                    want[i, : (max(0, min(num_kv, q_offset + i + 1)) if causal else num_kv)] = True
                got = torch.zeros_like(want)
                for c in prefill_calls(num_q, num_kv, q_offset, causal):
                    assert 0 < c.kv_len <= num_kv
                    assert not c.causal or c.q_hi - c.q_lo <= c.kv_len  # no fully masked row
                    diag = c.kv_len - (c.q_hi - c.q_lo)  # FlashInfer's bottom-right alignment
                    for i in range(c.q_lo, c.q_hi):
                        last = diag + i - c.q_lo if c.causal else c.kv_len - 1
                        got[i, : last + 1] = True
                assert torch.equal(got, want), (num_q, num_kv, q_offset)
    assert prefill_calls(8, 100, 92, True) == [(0, 8, 100, True)]  # the usual case: one call


def test_limits_are_named() -> None:
    ok = rand(4, 32, 128)
    s = torch.zeros(4, 32)
    assert can_run("merge_state", ok, s, ok, s)
    assert not can_run("merge_state", ok.float(), s, ok.float(), s)
    assert not can_run("merge_state", rand(4, 32, 96), s, rand(4, 32, 96), s)
    assert not can_run("merge_states", rand(4, 2, 128, 128), torch.zeros(4, 2, 128))
    assert can_run("merge_states", rand(4, 2, 128, 64), torch.zeros(4, 2, 128))
    assert not can_run("append_paged_kv", ok)
    assert not can_run("merge_state")  # malformed: no arguments
    cache = rand(8, 16, 8, 128)
    assert not can_run("paged_attention", ok, cache.transpose(1, 2), cache, None, None, None)
    with pytest.raises(FlashInferLimitError, match="head_dim in"):
        ops.chunked_prefill_attention(rand(4, 8, 96), rand(9, 2, 96), rand(9, 2, 96), 5, True, 1.0)
    with pytest.raises(ValueError, match="num_heads <= 32"):
        ops.merge_states(rand(2, 3, 64, 256), torch.zeros(2, 3, 64))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        ops.merge_state(ok.float(), s, ok.float(), s)


# ----------------------------------------------------- CPU: adapter plumbing over a stand-in


def _base2_merge(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer-style merge of ``[T, N, H, D]``/``[T, N, H]`` base-2 states, naive on empties."""
    m = s.double().amax(1, keepdim=True)
    w = torch.exp2(s.double() - m)  # NaN where every state is empty, as in older kernels
    o = (v.double() * w.unsqueeze(-1)).sum(1) / w.sum(1).unsqueeze(-1)
    return o.to(v.dtype), (m.squeeze(1) + torch.log2(w.sum(1))).float()


def _base2_attention(q, k, v, causal, sm_scale):
    o, lse = attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)
    return o.to(q.dtype), (lse * math.log2(math.e)).float()


class _FakeWrapper:
    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8

    def plan(self, qo, kv_indptr, kv_indices, last, hq, hkv, d, page, *, causal, sm_scale, **kw):
        for t in (qo, kv_indptr, kv_indices, last):
            assert t.dtype == torch.int32
        assert ((last >= 1) & (last <= page)).all()
        self.args = (qo.tolist(), kv_indptr.tolist(), kv_indices, last.tolist(), page)
        self.causal, self.sm_scale = causal, sm_scale

    def run(self, q, kv, *, return_lse):
        qo, indptr, indices, last, page = self.args
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        for b in range(len(qo) - 1):
            pages = indices[indptr[b] : indptr[b + 1]].long()
            n = (len(pages) - 1) * page + last[b]
            k, v = (c[pages].flatten(0, 1)[:n] for c in kv)
            lo, hi = qo[b], qo[b + 1]
            out[lo:hi], lse[lo:hi] = _base2_attention(q[lo:hi], k, v, self.causal, self.sm_scale)
        return out, lse


def _fake_in_place(v, s, v_other, s_other, mask=None):
    o, lse = _base2_merge(torch.stack((v, v_other), 1), torch.stack((s, s_other), 1))
    rows = torch.ones(v.shape[0], dtype=torch.bool) if mask is None else mask
    v[rows], s[rows] = o[rows], lse[rows]


def _fake_prefill(q, k, v, *, causal, kv_layout, sm_scale, return_lse):
    assert kv_layout == "NHD" and return_lse and k.is_contiguous()
    assert not causal or q.shape[0] <= k.shape[0]  # the adapter never asks for masked rows
    return _base2_attention(q, k, v, causal, sm_scale)


FAKE = types.SimpleNamespace(
    merge_state=lambda va, sa, vb, sb: _base2_merge(
        torch.stack((va, vb), 1), torch.stack((sa, sb), 1)
    ),
    merge_states=_base2_merge,
    merge_state_in_place=_fake_in_place,
    single_prefill_with_kv_cache=_fake_prefill,
    BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
)


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "load", lambda: FAKE)
    monkeypatch.setattr(ops, "_WRAPPERS", {})
    monkeypatch.setattr(ops, "WORKSPACE_BYTES", 1024)


def _states(t: int, n: int, h: int, d: int, device: str = "cpu"):
    """Random states with empty (-inf, +inf, NaN) entries and some all-empty rows, garbage v."""
    v, s = rand(t, n, h, d, device=device), torch.randn(t, n, h, device=device) * 3
    s[torch.rand(t, n, h, device=device) < 0.2] = -INF
    s[torch.rand(t, n, h, device=device) < 0.1] = INF
    s[torch.rand(t, n, h, device=device) < 0.1] = NAN
    s[: t // 4] = -INF  # both/all empty
    v[torch.rand(t, n, h, device=device) < 0.1] = NAN  # garbage (only seen through empties)
    v = torch.where(torch.isfinite(s).unsqueeze(-1), v.nan_to_num(0), v)
    return v, s


def _check_merge(v, s, vin, sin) -> None:
    assert_twice_torch(v, *(merge_ref(vin, sin, upcast=u)[0] for u in (True, False)), what="v")
    assert_twice_torch(s, *(merge_ref(vin, sin, upcast=u)[1] for u in (True, False)), what="s")
    empty = torch.isneginf(s)
    assert (v[empty] == 0).all()


@pytest.mark.usefixtures("fake_flashinfer")
def test_plumbing_merges() -> None:
    vs, ss = _states(32, 3, 4, 64)
    _check_merge(*ops.merge_states(vs, ss), vs, ss)
    _check_merge(*ops.merge_state(vs[:, 0], ss[:, 0], vs[:, 1], ss[:, 1]), vs[:, :2], ss[:, :2])
    out = ops.merge_states(vs[:, :0], ss[:, :0])
    assert (out[0] == 0).all() and torch.isneginf(out[1]).all()
    mask = torch.rand(32) < 0.5
    v, s = vs[:, 0].transpose(0, 1).contiguous().transpose(0, 1), ss[:, 0].clone()  # strided v
    v0, s0 = v.clone(), s.clone()
    ops.merge_state_in_place(v, s, vs[:, 1], ss[:, 1], mask)
    assert torch.equal(v[~mask].view(torch.int16), v0[~mask].view(torch.int16))
    assert torch.equal(s[~mask].view(torch.int32), s0[~mask].view(torch.int32))
    _check_merge(v[mask], s[mask], vs[mask, :2], ss[mask, :2])


def _sentinel_merge(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer 0.5's merges: -inf is the finite sentinel -5e4 (``math::inf = 5e4``), so
    an all-empty row comes back with v 0 and a *finite* LSE near -5e4."""
    return _base2_merge(v, s.clamp(min=-5e4))


def _sentinel_in_place(v, s, v_other, s_other, mask=None):
    o, lse = _sentinel_merge(torch.stack((v, v_other), 1), torch.stack((s, s_other), 1))
    rows = torch.ones(v.shape[0], dtype=torch.bool) if mask is None else mask
    v[rows], s[rows] = o[rows], lse[rows]


SENTINEL = types.SimpleNamespace(
    **{
        **vars(FAKE),
        "merge_state": lambda va, sa, vb, sb: _sentinel_merge(
            torch.stack((va, vb), 1), torch.stack((sa, sb), 1)
        ),
        "merge_states": _sentinel_merge,
        "merge_state_in_place": _sentinel_in_place,
    }
)


def test_merges_with_a_finite_minus_inf_keep_the_empty_convention(monkeypatch) -> None:
    """All-empty rows are exactly (0, -inf) and one-live rows the live state exactly, though
    the kernel returns a finite LSE for an all-empty merge (the GPU failure of FlashInfer 0.5.3)."""
    monkeypatch.setattr(ops, "load", lambda: SENTINEL)
    vs, ss = _states(64, 3, 4, 64)
    live = torch.isfinite(ss)  # [T, N, H]

    def check(v, s, n, rows=slice(None)) -> None:
        lv = live[rows, :n]
        none, one = lv.sum(1) == 0, lv.sum(1) == 1
        assert none.any() and one.any()
        assert torch.isneginf(s[none]).all() and (v[none] == 0).all()
        idx = lv.int().argmax(1, keepdim=True)
        s_one = ss[rows, :n].gather(1, idx).squeeze(1)
        v_one = vs[rows, :n].gather(1, idx.unsqueeze(-1).expand(-1, -1, -1, 64)).squeeze(1)
        assert torch.equal(s[one], s_one[one]) and torch.equal(v[one], v_one[one])
        _check_merge(v, s, vs[rows, :n], ss[rows, :n])

    check(*ops.merge_states(vs, ss), 3)
    check(*ops.merge_state(vs[:, 0], ss[:, 0], vs[:, 1], ss[:, 1]), 2)
    for mask in (None, torch.rand(64) < 0.5):
        v, s = vs[:, 0].clone(), ss[:, 0].clone()
        v0, s0 = v.clone(), s.clone()
        ops.merge_state_in_place(v, s, vs[:, 1], ss[:, 1], mask)
        rows = torch.ones(64, dtype=torch.bool) if mask is None else mask
        assert torch.equal(v[~rows].view(torch.int16), v0[~rows].view(torch.int16))
        assert torch.equal(s[~rows].view(torch.int32), s0[~rows].view(torch.int32))
        check(v[rows], s[rows], 2, rows)


def test_fix_empty_merge() -> None:
    nan, inf = float("nan"), float("inf")
    s_in = [torch.tensor([[-inf, 1.0, -inf, 2.0]]), torch.tensor([[nan, -inf, 3.0, 4.0]])]
    v_in = [torch.full((1, 4, 2), x) for x in (5.0, 6.0)]
    v_in[0][0, 0] = nan  # an empty state's garbage must not leak
    v, s = torch.full((1, 4, 2), 7.0), torch.full((1, 4), -34657.0)  # what the kernel said
    v2, s2 = fix_empty_merge(v, s, v_in, s_in)
    assert s2.tolist() == [[-inf, 1.0, 3.0, -34657.0]]
    assert v2[0, :, 0].tolist() == [0.0, 5.0, 6.0, 7.0]
    assert v2.dtype == v.dtype and s2.dtype == torch.float32
    assert s.tolist() == [[-34657.0] * 4]  # the arguments are not written


@pytest.mark.usefixtures("fake_flashinfer")
@pytest.mark.parametrize(("q_offset", "causal"), [(None, True), (-3, True), (20, True), (5, False)])
def test_plumbing_prefill(q_offset: int | None, causal: bool) -> None:
    q, k, v = rand(12, 8, 64), rand(30, 2, 64), rand(30, 2, 64)
    off = 30 - 12 if q_offset is None else q_offset
    o, lse = ops.chunked_prefill_attention(q, k, v, off, causal, 0.125)
    for got, want, base in zip(
        (o, lse),
        attention_ref(q, k, v, q_offset=off, causal=causal, sm_scale=0.125),
        attention_ref(q, k, v, q_offset=off, causal=causal, sm_scale=0.125, upcast=False),
        strict=True,
    ):
        assert_twice_torch(got, want, base)


@pytest.mark.usefixtures("fake_flashinfer")
def test_plumbing_paged() -> None:
    block, lens, nq = 16, [50, 1, 33, 64, 7], [4, 1, 0, 1, 7]
    cache_k, cache_v = rand(40, block, 2, 64), rand(40, block, 2, 64)
    table = torch.randperm(40, dtype=torch.int32)[:20].view(5, 4)
    cu = torch.tensor([0, *torch.tensor(nq).cumsum(0).tolist()], dtype=torch.int32)
    q = rand(int(cu[-1]), 8, 64)
    o, lse = ops.paged_attention(
        q, cache_k, cache_v, cu, torch.tensor(lens, dtype=torch.int32), table, True, 0.125
    )
    for b, n in enumerate(lens):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if lo == hi:
            continue
        k, v = paged_to_dense(cache_k, table[b], n), paged_to_dense(cache_v, table[b], n)
        for got, want, base in zip(
            (o[lo:hi], lse[lo:hi]),
            attention_ref(q[lo:hi], k, v, sm_scale=0.125),
            attention_ref(q[lo:hi], k, v, sm_scale=0.125, upcast=False),
            strict=True,
        ):
            assert_twice_torch(got, want, base)


# ------------------------------------------------------------------ GPU: the real kernels

FI = "flashinfer"
CUDA = "cuda"


def _compare_attention(o, lse, q, k, v, **kw) -> None:
    truth, base = attention_ref(q, k, v, **kw), attention_ref(q, k, v, upcast=False, **kw)
    assert_twice_torch(o, truth[0], base[0], what="o")
    assert_twice_torch(lse, truth[1], base[1], what="lse")


@needs_flashinfer
class TestOnGPU:
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    @pytest.mark.parametrize(("heads", "head_dim"), [(32, 128), (16, 64), (8, 256)])
    def test_merges(self, dtype, heads, head_dim) -> None:
        vs, ss = _states(513, 4, heads, head_dim, device=CUDA)
        vs = vs.to(dtype)
        _check_merge(*merge_states(vs, ss, backend=FI), vs, ss)
        pair = (vs[:, 0], ss[:, 0], vs[:, 1], ss[:, 1])
        _check_merge(*merge_state(*pair, backend=FI), vs[:, :2], ss[:, :2])
        for mask in (None, torch.rand(513, device=CUDA) < 0.5):
            v, s = vs[:, 0].clone(), ss[:, 0].clone()
            v0, s0 = v.clone(), s.clone()
            merge_state_in_place(v, s, vs[:, 1], ss[:, 1], mask=mask, backend=FI)
            rows = torch.ones(513, dtype=torch.bool, device=CUDA) if mask is None else mask
            assert torch.equal(v[~rows].view(torch.int16), v0[~rows].view(torch.int16))
            assert torch.equal(s[~rows].view(torch.int32), s0[~rows].view(torch.int32))
            _check_merge(v[rows], s[rows], vs[rows, :2], ss[rows, :2])

    @pytest.mark.parametrize("where", ["start", "middle", "end"])
    @pytest.mark.parametrize("group", [4, 8])
    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("full_kv", [False, True])
    def test_chunked_prefill(self, where, group, head_dim, full_kv) -> None:
        num_kv, c = 1500, 256
        offset = {"start": 0, "middle": 611, "end": num_kv - c}[where]
        kv_len = num_kv if full_kv else offset + c  # full_kv: keys after the chunk are masked
        q = rand(c, 2 * group, head_dim, device=CUDA)
        k, v = rand(kv_len, 2, head_dim, device=CUDA), rand(kv_len, 2, head_dim, device=CUDA)
        o, lse = chunked_prefill_attention(q, k, v, q_offset=offset, backend=FI)
        _compare_attention(o, lse, q, k, v, q_offset=offset)

    @pytest.mark.parametrize("q_offset", [-40, 100, 2000])  # empty rows; rows past the KV
    def test_prefill_odd_offsets(self, q_offset) -> None:
        q, k, v = (rand(n, h, 128, device=CUDA) for n, h in ((96, 32), (1000, 8), (1000, 8)))
        o, lse = chunked_prefill_attention(q, k, v, q_offset=q_offset, backend=FI)
        _compare_attention(o, lse, q, k, v, q_offset=q_offset)

    @pytest.mark.parametrize(("group", "head_dim"), [(4, 128), (8, 64)])
    def test_paged_mixed_batch(self, group, head_dim) -> None:
        block, lens, nq = 16, [3000, 17, 1, 512, 900, 64], [300, 17, 1, 1, 0, 1]
        num_blocks = sum(-(-n // block) for n in lens) + 11
        kc, vc = (rand(num_blocks, block, 4, head_dim, device=CUDA) for _ in range(2))
        perm = torch.randperm(num_blocks, device=CUDA).to(torch.int32)
        table = torch.zeros(len(lens), -(-max(lens) // block), dtype=torch.int32, device=CUDA)
        used = 0
        for b, n in enumerate(lens):
            table[b, : -(-n // block)] = perm[used : used + -(-n // block)]
            used += -(-n // block)
        cu = torch.tensor([0, *torch.tensor(nq).cumsum(0).tolist()], dtype=torch.int32).to(CUDA)
        q = rand(int(cu[-1]), 4 * group, head_dim, device=CUDA)
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
        o, lse = paged_attention(
            q, kc, vc, cu_seqlens_q=cu, kv_lens=kv_lens, block_table=table, backend=FI
        )
        for b, n in enumerate(lens):
            lo, hi = int(cu[b]), int(cu[b + 1])
            if lo == hi:
                continue
            k, v = paged_to_dense(kc, table[b], n), paged_to_dense(vc, table[b], n)
            _compare_attention(o[lo:hi], lse[lo:hi], q[lo:hi], k, v)

    def test_kvp_merge_matches_unsharded_attention(self) -> None:
        """Catches a base-2/natural LSE mix-up, which random-LSE merge tests cannot."""
        num_kv, c, split = 4096, 128, 1536
        q = rand(c, 32, 128, device=CUDA)
        k, v = rand(num_kv, 8, 128, device=CUDA), rand(num_kv, 8, 128, device=CUDA)
        off = num_kv - c
        o0, s0 = chunked_prefill_attention(
            q, k[:split], v[:split], q_offset=off, causal=False, backend=FI
        )
        o1, s1 = chunked_prefill_attention(
            q, k[split:], v[split:], q_offset=off - split, backend=FI
        )
        o, s = merge_state(o0, s0, o1, s1, backend=FI)
        _compare_attention(o, s, q, k, v)
        whole_o, whole_s = chunked_prefill_attention(q, k, v, backend=FI)
        assert torch.allclose(s, whole_s, atol=1e-3)  # base-2 LSEs would be off by 1/ln2
        torch_o, _ = merge_state(o0, s0, o1, s1, backend="torch")
        assert (o.float() - torch_o.float()).abs().max() < 2e-2
        assert (whole_o.float() - o.float()).abs().max() < 2e-2

    def test_limits_raise_on_gpu(self) -> None:
        q, k = rand(4, 8, 96, device=CUDA), rand(9, 2, 96, device=CUDA)
        with pytest.raises(ValueError, match="head_dim in"):
            chunked_prefill_attention(q, k, k, backend=FI)
