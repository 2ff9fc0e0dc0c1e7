"""One step's paged attention, planned once and run by every layer.

A step mixes two decodes and a 40-token prefill chunk over a paged KV cache
(blocks of 16, in any order). ``plan_paged_attention`` validates the batch
metadata once and picks the backend (on the CPU: the native C++ kernel when a
compiler is present); each layer then calls ``plan.run`` on its own cache,
with no host sync. The result is checked against the torch backend.

    python examples/kernels_paged_plan.py
"""

from __future__ import annotations

import torch

from medha_kernels import paged_attention, plan_paged_attention

torch.manual_seed(0)
layers, blocks, block_size, heads, kv_heads, head_dim = 4, 32, 16, 9, 3, 64
caches = [
    (
        torch.randn(blocks, block_size, kv_heads, head_dim),
        torch.randn(blocks, block_size, kv_heads, head_dim),
    )
    for _ in range(layers)
]
chunks, kv_lens = [1, 40, 1], [100, 140, 17]  # new tokens and keys per sequence
cu_seqlens_q = torch.tensor([0, 1, 41, 42], dtype=torch.int32)
kv = torch.tensor(kv_lens, dtype=torch.int32)
table = torch.randperm(blocks)[: 3 * 9].reshape(3, 9).to(torch.int32)  # 9 blocks each

plan = plan_paged_attention(
    cu_seqlens_q=cu_seqlens_q,
    kv_lens=kv,
    block_table=table,
    num_qo_heads=heads,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    block_size=block_size,
)
print(f"planned once on backend {plan.backend!r}")
for i, (k_cache, v_cache) in enumerate(caches):
    q = torch.randn(sum(chunks), heads, head_dim)
    o, lse = plan.run(q, k_cache, v_cache)
    o_ref, lse_ref = paged_attention(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q,
        kv_lens=kv,
        block_table=table,
        backend="torch",
    )
    err = (o - o_ref).abs().max().item()
    print(f"layer {i}: o {tuple(o.shape)}, lse {tuple(lse.shape)}, max |o - torch| {err:.1e}")
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(lse, lse_ref, atol=1e-5)
