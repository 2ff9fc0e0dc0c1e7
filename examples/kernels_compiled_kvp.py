"""KV-parallel attention inside ``torch.compile``, through the ``torch.ops.medha`` custom ops.

``import medha_kernels.library`` registers the public ops as custom ops with
fake kernels, so a function that attends over two KV shards and merges their
partial states traces into one graph (``fullgraph=True``: no graph break at
the kernels' Python dispatch). The compiled function gives the eager one's
result, and the merged state is the attention over the whole KV.

    python examples/kernels_compiled_kvp.py
"""

from __future__ import annotations

import torch

import medha_kernels
import medha_kernels.library  # registers torch.ops.medha.*

ops = torch.ops.medha
torch.manual_seed(0)
num_q, num_kv, heads, kv_heads, head_dim = 6, 40, 8, 2, 32
q = torch.randn(num_q, heads, head_dim)
k = torch.randn(num_kv, kv_heads, head_dim)
v = torch.randn(num_kv, kv_heads, head_dim)
split = 24  # shard 0 holds keys [0, 24), shard 1 the rest and the query chunk


def kvp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``q [num_q, heads, head_dim]`` over two shards, merged: ``(o, lse)``."""
    o0, s0 = ops.chunked_prefill_attention(q, k[:split], v[:split], None, False, None, "auto")
    offset = num_kv - num_q - split  # query 0's position inside shard 1
    o1, s1 = ops.chunked_prefill_attention(q, k[split:], v[split:], offset, True, None, "auto")
    return ops.merge_state(o0, s0, o1, s1, "auto")


compiled = torch.compile(kvp_attention, fullgraph=True, backend="aot_eager")
o, lse = compiled(q, k, v)
o_eager, lse_eager = kvp_attention(q, k, v)
o_whole, lse_whole = medha_kernels.chunked_prefill_attention(q, k, v)
print(f"compiled o {tuple(o.shape)}, lse {tuple(lse.shape)} {lse.dtype}")
print(f"compiled == eager: {torch.equal(o, o_eager) and torch.equal(lse, lse_eager)}")
print(f"max |merged - whole attention|: {(o - o_whole).abs().max().item():.1e}")
assert torch.equal(o, o_eager) and torch.equal(lse, lse_eager)
# the merge of exact partial states is the whole attention up to fp32 rounding
assert torch.allclose(o, o_whole, atol=1e-5) and torch.allclose(lse, lse_whole, atol=1e-5)
