"""``medha_kernels.decode_ops``: native rotary and K/V write against the torch paths they replace.

The rotation must give torch's bits (``apply_rotary_``'s five ops: each product
and the sum rounded once); the write must put exactly ``index_copy_``'s rows in
the cache and nothing else. Odd shapes and strided views (the q and k heads of
a fused QKV output) on purpose.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from medha_kernels import native
from medha_runtime.model.config import RopeConfig
from medha_runtime.model.rope import RotaryEmbedding, apply_rotary, apply_rotary_, rotary_tables

ops = importlib.import_module("medha_kernels.decode_ops")

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="needs a C++ compiler and ninja"
)


def _torch_rotary_(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "_module", lambda: None)
        assert not ops.rotary_(x, cos2, sin2)
        apply_rotary_(x, cos2, sin2)


@pytest.mark.parametrize("tokens", [1, 3, 17, 200])
@pytest.mark.parametrize(("heads", "head_dim"), [(1, 2), (6, 16), (3, 64), (5, 128), (2, 10)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
def test_rotary_is_torch_bit_for_bit(tokens: int, heads: int, head_dim: int, scale: float) -> None:
    g = torch.Generator().manual_seed(tokens * 100 + heads * 10 + head_dim)
    rope = RotaryEmbedding(
        RopeConfig(rope_type="default", theta=10000.0),
        head_dim=head_dim,
        max_position_embeddings=70000,
    )
    positions = torch.randint(0, 65536, (tokens,), generator=g)
    cos2, sin2 = rotary_tables(*rope.cos_sin(positions, torch.float32))
    # the q and k heads of a fused projection: a strided view, v's columns after them
    qkv = torch.randn(tokens, (heads + 1) * head_dim, generator=g) * scale
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    want_qkv = qkv.clone()
    _torch_rotary_(want_qkv[:, : heads * head_dim].view(tokens, heads, head_dim), cos2, sin2)
    assert ops.rotary_(x, cos2, sin2)
    assert torch.equal(qkv, want_qkv)  # rotated heads and untouched columns alike
    # and both are transformers' x * cos + rotate_half(x) * sin
    cos, sin = rope.cos_sin(positions, torch.float32)
    fresh = (torch.randn(tokens, heads, head_dim, generator=g) * scale).contiguous()
    want = apply_rotary(fresh, cos, sin)
    apply_rotary_(fresh, cos2, sin2)
    assert torch.equal(fresh, want)


def test_rotary_declines_what_it_cannot_run() -> None:
    cos2, sin2 = rotary_tables(torch.ones(2, 4), torch.zeros(2, 4))
    for x in (torch.ones(2, 1, 8, dtype=torch.float64), torch.ones(2, 1, 16)[:, :, ::2]):
        assert not ops.rotary_(x, cos2.to(x.dtype), sin2.to(x.dtype))
    bf = torch.ones(2, 1, 8, dtype=torch.bfloat16)
    assert not ops.rotary_(bf, cos2.bfloat16(), sin2.bfloat16())
    with pytest.raises(RuntimeError, match="cos2 and sin2 must be fp32 CPU"):
        ops._module().rotary_(torch.ones(3, 1, 8), cos2, sin2)
    # tables broadcast over the tokens: the caller's torch path, not an error
    assert not ops.rotary_(torch.ones(3, 1, 8), cos2[:1], sin2[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_write_kv_is_index_copy(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    blocks, block, heads, d = 9, 4, 3, 10
    shape = (blocks, block, heads, d)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(rows, 3 * heads * d, generator=g).to(dtype)
    k = kv[:, heads * d : 2 * heads * d].view(rows, heads, d)  # strided views, as a QKV output
    v = kv[:, 2 * heads * d :].view(rows, heads, d)
    index = torch.randperm(blocks * block, generator=g)[:rows]
    want_k.view(-1, heads, d).index_copy_(0, index, k)
    want_v.view(-1, heads, d).index_copy_(0, index, v)
    assert ops.write_kv(k, v, k_cache, v_cache, index)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="outside the cache's 36 slots"):
        ops.write_kv(k, v, k_cache, v_cache, torch.full((rows,), blocks * block))
    assert not ops.write_kv(k, v, k_cache, v_cache, index.int())  # int32: the caller's path
    assert not ops.write_kv(k, v, k_cache[:, :2], v_cache[:, :2], index)  # not contiguous
    strided = torch.stack([index, index], dim=1)[:, 0]  # a valid int64 index, strided
    assert ops.write_kv(k, v, k_cache, v_cache, strided) is (rows == 1)  # 1 row: contiguous
    assert not ops.write_kv(k, v, k_cache, v_cache[:, :, :1].contiguous(), index)  # other shape


@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 16, 33, 200])
@pytest.mark.parametrize(
    "rope",
    [
        RopeConfig(rope_type="default", theta=10000.0),
        RopeConfig(rope_type="default", theta=500000.0),
        RopeConfig(
            rope_type="yarn",
            theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=2048,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
    ],
)
@pytest.mark.parametrize("head_dim", [2, 16, 64, 10])
def test_rotary_tables_are_torch_bit_for_bit(tokens: int, rope: RopeConfig, head_dim: int) -> None:
    """The step's tables in one native call: the same bits as ``rotary_tables(*cos_sin())``
    (cos and sin of positions x inverse frequencies, the yarn scale, -sin and sin), at
    positions up to a million (large arguments of cos and sin)."""
    emb = RotaryEmbedding(rope, head_dim=head_dim, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(tokens * 7 + head_dim)
    positions = torch.randint(0, 1 << 20, (tokens,), generator=g)
    positions[0] = 0
    got = ops.rotary_tables(positions, emb.inv_freq, emb.scale)
    assert got is not None
    want = rotary_tables(*emb.cos_sin(positions))
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape == (tokens, 1, 2, head_dim // 2) and a.dtype == torch.float32
        assert torch.equal(a, b)
    assert got[0].stride() == want[0].stride()  # cos2: the same broadcast view
    # what RotaryEmbedding.tables gives a layer, fp32 on the CPU: the native call's bits
    for a, b in zip(emb.tables(positions), want, strict=True):
        assert torch.equal(a, b)
    # other dtypes: cos_sin and rotary_tables (bf16 rounds cos and sin first)
    for a, b in zip(
        emb.tables(positions, torch.bfloat16),
        rotary_tables(*emb.cos_sin(positions, torch.bfloat16)),
        strict=True,
    ):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_rotary_tables_decline_what_they_cannot_run(monkeypatch) -> None:
    inv = torch.rand(8)
    assert ops.rotary_tables(torch.arange(3, dtype=torch.int32), inv) is None
    assert ops.rotary_tables(torch.arange(3), inv.double()) is None
    module = ops._module()
    assert module.rotary_tables(torch.arange(3), inv[::2], 1.0) is None  # non-contiguous
    assert module.rotary_tables(torch.arange(6).view(2, 3), inv, 1.0) is None
    monkeypatch.setattr(ops, "_module", lambda: None)
    assert ops.rotary_tables(torch.arange(3), inv) is None
    emb = RotaryEmbedding(
        RopeConfig(rope_type="default", theta=1e4), head_dim=16, max_position_embeddings=64
    )
    positions = torch.arange(5)
    for a, b in zip(emb.tables(positions), rotary_tables(*emb.cos_sin(positions)), strict=True):
        assert torch.equal(a, b)
