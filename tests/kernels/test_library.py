"""``torch.ops.medha.*``: the public ops as custom ops, checked by ``opcheck`` and in graphs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import medha_kernels  # noqa: E402
from medha_kernels import library  # noqa: E402, F401  (registers torch.ops.medha)

OPS = torch.ops.medha

# opcheck's default utilities minus autograd registration (no op is differentiable)
UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _paged(num_q=(3, 1), kv=(7, 21), hq=4, hk=2, d=16, bs=4, dtype=torch.float32):
    """A two-sequence paged batch (a prefill chunk and a decode) with shuffled blocks."""
    blocks = [-(-n // bs) for n in kv]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, dtype=torch.int32)
    table = torch.zeros(len(kv), max(blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used : used + n]
        used += n
    return {
        "q": torch.randn(sum(num_q), hq, d, dtype=dtype),
        "k_cache": torch.randn(num_blocks, bs, hk, d, dtype=dtype),
        "v_cache": torch.randn(num_blocks, bs, hk, d, dtype=dtype),
        "cu_seqlens_q": torch.tensor([0, num_q[0], sum(num_q)], dtype=torch.int32),
        "kv_lens": torch.tensor(kv, dtype=torch.int32),
        "block_table": table,
    }


def _state(t=5, h=3, d=8, dtype=torch.float32):
    s = torch.randn(t, h)
    s[0, 0] = float("-inf")  # an empty state among them
    return torch.randn(t, h, d, dtype=dtype), s


def _cases():
    """(op name, args, kwargs) of every op at small odd sizes."""
    p = _paged()
    q, k, v = torch.randn(5, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    (va, sa), (vb, sb) = _state(), _state()
    vs, ss = torch.randn(5, 3, 2, 8), torch.randn(5, 3, 2)
    kn, vn = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, -1, 2], dtype=torch.int32)
    return [
        ("chunked_prefill_attention", (q, k, v, 4, True, None, "torch"), {}),
        ("chunked_prefill_attention", (q, k, v, None, False, 0.3, "auto"), {}),
        ("paged_attention", (*p.values(), True, None, "torch"), {}),
        ("merge_state", (va, sa, vb, sb, "torch"), {}),
        ("merge_state_in_place", (va.clone(), sa.clone(), vb, sb, None, "torch"), {}),
        ("merge_states", (vs, ss, "torch"), {}),
        ("append_paged_kv", (kn, vn, p["k_cache"].clone(), p["v_cache"].clone(), slots), {}),
    ]


@pytest.mark.parametrize("case", range(7))
def test_opcheck(case: int) -> None:
    name, args, kwargs = _cases()[case]
    torch.library.opcheck(getattr(OPS, name), args, kwargs, test_utils=UTILS)


def test_ops_give_the_functions_results_bit_for_bit() -> None:
    p = _paged()
    o, lse = OPS.paged_attention(*p.values(), True, None, "torch")
    o2, lse2 = medha_kernels.paged_attention(
        p["q"],
        p["k_cache"],
        p["v_cache"],
        cu_seqlens_q=p["cu_seqlens_q"],
        kv_lens=p["kv_lens"],
        block_table=p["block_table"],
        backend="torch",
    )
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    (va, sa), (vb, sb) = _state(), _state()
    v, s = OPS.merge_state(va, sa, vb, sb, "torch")
    v2, s2 = medha_kernels.merge_state(va, sa, vb, sb, backend="torch")
    assert torch.equal(v, v2) and torch.equal(s, s2)
    assert s[0, 0] > float("-inf") or sb[0, 0] == float("-inf")


def test_in_place_ops_mutate_their_declared_arguments() -> None:
    (va, sa), (vb, sb) = _state(), _state()
    want_v, want_s = medha_kernels.merge_state(va, sa, vb, sb, backend="torch")
    OPS.merge_state_in_place(va, sa, vb, sb, None, "torch")
    assert torch.equal(va, want_v) and torch.equal(sa, want_s)
    p = _paged()
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    OPS.append_paged_kv(k, v, p["k_cache"], p["v_cache"], torch.tensor([3, 9], dtype=torch.int32))
    assert torch.equal(p["k_cache"][0, 3], k[0]) and torch.equal(p["v_cache"][2, 1], v[1])


def test_fake_kernels_give_shapes_and_dtypes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p = _paged(dtype=torch.bfloat16)
        o, lse = OPS.paged_attention(*p.values(), True, None, "auto")
        v, s = OPS.merge_states(torch.empty(6, 3, 2, 8), torch.empty(6, 3, 2), "auto")
    assert o.shape == (4, 4, 16) and o.dtype == torch.bfloat16
    assert lse.shape == (4, 4) and lse.dtype == torch.float32
    assert v.shape == (6, 2, 8) and s.shape == (6, 2) and s.dtype == torch.float32


def test_a_kvp_step_compiles_to_one_graph() -> None:
    """Attention over two KV shards and their merge, traced whole (fullgraph)."""
    q, k, v = torch.randn(5, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)

    def sharded(q, k, v):
        o1, s1 = OPS.chunked_prefill_attention(q, k[:6], v[:6], None, False, None, "torch")
        o2, s2 = OPS.chunked_prefill_attention(q, k[6:], v[6:], 1, True, None, "torch")
        return OPS.merge_state(o1, s1, o2, s2, "torch")

    torch._dynamo.reset()
    compiled = torch.compile(sharded, fullgraph=True, backend="aot_eager")
    o, s = compiled(q, k, v)
    want_o, want_s = sharded(q, k, v)  # the same ops, eager
    assert torch.equal(o, want_o) and torch.equal(s, want_s)
    assert torch.isfinite(s).all()
