"""``medha_kernels.linear.rms_norm_qkv_rotary``: a decode layer from its input norm to its
attention's query in one native call (RMSNorm with the residual add, the fused q/k/v
projection, rotary on the q and k heads, the K/V write).

It must give exactly the bits of the calls it replaces (``rms_norm``, ``linear``,
``decode_ops.rotary_`` on the q and k heads of the projection, ``decode_ops.write_kv``),
so the model's tokens cannot change, and its query must stay within twice plain torch's
fp32 error of a float64 truth. What it does not take (other dtypes, strides, shapes,
too many rows, autograd) returns None and touches nothing.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from medha_kernels import native, rms_norm
from medha_kernels.decode_ops import rotary_, write_kv
from medha_kernels.linear import linear, native_row_limit, rms_norm_qkv_rotary

from .reference import assert_twice_torch

linear_module = importlib.import_module("medha_kernels.linear")

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="needs a C++ compiler and ninja"
)

EPS = 1e-5
BLOCKS, BLOCK = 20, 4


def _tables(positions: torch.Tensor, d: int):
    """cos2, sin2 as ``rotary_tables`` makes them, for positions and head_dim ``d``."""
    from medha_runtime.model.rope import rotary_tables

    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float().unsqueeze(-1) * inv
    return rotary_tables(freqs.cos(), freqs.sin()), freqs.double()


def _inputs(m: int, k: int, hq: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    r = torch.randn(m, k, generator=g)
    nw = torch.randn(k, generator=g) * 0.2 + 1
    w = torch.randn((hq + 2 * hkv) * d, k, generator=g) / k**0.5
    positions = torch.randint(0, 5000, (m,), generator=g)
    (cos2, sin2), freqs = _tables(positions, d)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:m]
    return x, r, nw, w, cos2, sin2, freqs, slots


def _calls(x, r, nw, w, hq, hkv, d, cos2, sin2, k_cache, v_cache, slots):
    """What a layer ran before: the norm, the projection, rotary on q and k, the write."""
    h, normed = rms_norm(x, nw, EPS, r)
    qkv = linear(normed, w)
    m = x.shape[0]
    qk = qkv[:, : (hq + hkv) * d].view(m, hq + hkv, d)
    assert rotary_(qk, cos2, sin2)
    if k_cache is not None:
        v = qkv[:, (hq + hkv) * d :].view(m, hkv, d)
        assert write_kv(qk[:, hq:], v, k_cache, v_cache, slots)
    return h, qk[:, :hq].contiguous(), qkv


def _caches(hkv: int, d: int):
    k = torch.randn(BLOCKS, BLOCK, hkv, d)
    return k, torch.randn(BLOCKS, BLOCK, hkv, d)


@pytest.mark.parametrize("m", [1, 2, 5, 9, 17, 33, 64])
@pytest.mark.parametrize(
    ("k", "hq", "hkv", "d"), [(64, 4, 2, 16), (576, 9, 3, 64), (37, 2, 2, 6), (100, 15, 5, 8)]
)
@pytest.mark.parametrize("residual", [True, False])
def test_the_same_bits_as_the_calls_and_within_twice_torch(
    m: int, k: int, hq: int, hkv: int, d: int, residual: bool
) -> None:
    x, r, nw, w, cos2, sin2, freqs, slots = _inputs(m, k, hq, hkv, d, seed=m * 100 + k + hq)
    r = r if residual else None
    kc, vc = _caches(hkv, d)
    kc2, vc2 = kc.clone(), vc.clone()
    got = rms_norm_qkv_rotary(x, r, nw, EPS, w, hq, hkv, cos2, sin2, kc, vc, slots)
    assert got is not None
    h, q, qkv = got
    want_h, want_q, want_qkv = _calls(x, r, nw, w, hq, hkv, d, cos2, sin2, kc2, vc2, slots)
    assert h.shape == (m, k) and q.shape == (m, hq, d) and q.is_contiguous()
    assert torch.equal(h, want_h) and torch.equal(q, want_q) and torch.equal(qkv, want_qkv)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the same rows written, no other
    if r is None:
        assert h is x  # as rms_norm without a residual
    # without a cache nothing is written, the rest is the same
    h3, q3, qkv3 = rms_norm_qkv_rotary(x, r, nw, EPS, w, hq, hkv, cos2, sin2)
    assert torch.equal(q3, want_q) and torch.equal(qkv3, want_qkv) and torch.equal(h3, want_h)
    # the query against a float64 truth: norm, projection, rotation in float64
    hd = x.double() + (r.double() if r is not None else 0)
    nd = nw.double() * (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS))
    qd = (nd @ w.double().T)[:, : hq * d].view(m, hq, d)
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    q1, q2 = qd.chunk(2, dim=-1)
    truth = torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)
    plain_n = F.rms_norm(x + r if r is not None else x, (k,), nw, EPS)
    p1, p2 = F.linear(plain_n, w)[:, : hq * d].view(m, hq, d).chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    plain = torch.cat((p1 * c - p2 * s, p2 * c + p1 * s), dim=-1)
    assert_twice_torch(q, truth, plain, what=f"q m={m} k={k} heads={hq}/{hkv} d={d}")


def test_declines_what_it_does_not_take() -> None:
    module = native.get_module("cpu")
    limit = native_row_limit()
    assert limit > 0
    hq, hkv, d = 4, 2, 16
    x, r, nw, w, cos2, sin2, _, slots = _inputs(3, 40, hq, hkv, d, seed=7)
    kc, vc = _caches(hkv, d)
    kc0, vc0 = kc.clone(), vc.clone()
    base = {
        "x": x,
        "residual": r,
        "norm_weight": nw,
        "eps": EPS,
        "w_qkv": w,
        "num_q_heads": hq,
        "num_kv_heads": hkv,
        "cos2": cos2,
        "sin2": sin2,
        "k_cache": kc,
        "v_cache": vc,
        "index": slots,
        "max_rows": limit,
    }
    (cos5, sin5), _ = _tables(torch.arange(5), d)
    declined = {
        "rows over max_rows": {"max_rows": 2},
        "no rows": {"x": x[:0], "residual": r[:0]},
        "bf16 x": {"x": x.bfloat16()},
        "non-contiguous x": {"x": x.T.contiguous().T},
        "residual shape": {"residual": r[:, :-1].contiguous()},
        "norm weight shape": {"norm_weight": nw[:-1]},
        "non-contiguous weight": {"w_qkv": w.T.contiguous().T},
        "weight rows not heads": {"w_qkv": w[:-1].contiguous()},
        "odd head_dim": {"num_q_heads": 4 * d - 2 * hkv, "num_kv_heads": hkv},
        "no q heads": {"num_q_heads": 0},
        "tables of other rows": {"cos2": cos5, "sin2": sin5},
        "cache without index": {"index": None},
        "index without v cache": {"v_cache": None},
        "cache heads": {"k_cache": kc[:, :, :1].contiguous(), "v_cache": vc[:, :, :1].contiguous()},
        "non-contiguous cache": {"k_cache": kc.transpose(0, 1)},
        "int32 index": {"index": slots.int()},
        "index length": {"index": slots[:2]},
    }
    for what, change in declined.items():
        assert module.rms_norm_qkv_rotary(**(base | change)) is None, what
    wg = w.clone().requires_grad_(True)
    assert module.rms_norm_qkv_rotary(**(base | {"w_qkv": wg})) is None
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)  # nothing written
    with torch.no_grad():
        assert module.rms_norm_qkv_rotary(**(base | {"w_qkv": wg})) is not None
    # a slot past the cache is an error, not a write out of bounds
    with pytest.raises(RuntimeError, match="outside the cache"):
        module.rms_norm_qkv_rotary(**(base | {"index": slots + BLOCKS * BLOCK}))


def test_none_on_other_devices_or_opted_out(monkeypatch) -> None:
    x, r, nw, w, cos2, sin2, _, _ = _inputs(2, 16, 2, 1, 4, seed=3)
    monkeypatch.setattr(linear_module, "_front", lambda: (None, 0))
    assert rms_norm_qkv_rotary(x, r, nw, EPS, w, 2, 1, cos2, sin2) is None
    monkeypatch.undo()
    meta = x.to("meta")
    assert rms_norm_qkv_rotary(meta, None, nw, EPS, w, 2, 1, cos2, sin2) is None
