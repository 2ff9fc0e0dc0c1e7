"""KV-cache parallelism in miniature with medha_kernels.

A sequence's KV cache is split in two shards (think: two GPUs). Each shard
computes attention for the same query chunk over its own keys and returns a
partial output plus its log-sum-exp; ``merge_states`` combines the partials
exactly. The earlier shard lies wholly before the chunk, so it runs
non-causal; the tail shard holds the chunk's own keys and runs causal.

    python examples/kernels_kvp_merge.py
"""

from __future__ import annotations

import torch

from medha_kernels import available_backends, chunked_prefill_attention, merge_states

torch.manual_seed(0)
num_kv, chunk, heads, kv_heads, head_dim = 3000, 64, 32, 8, 128
q = torch.randn(chunk, heads, head_dim)
k = torch.randn(num_kv, kv_heads, head_dim)
v = torch.randn(num_kv, kv_heads, head_dim)
split = 2048  # shard 0 holds keys [0, 2048), shard 1 the rest (incl. the chunk)
q_offset = num_kv - chunk  # the chunk is the newest tokens

o0, s0 = chunked_prefill_attention(q, k[:split], v[:split], q_offset=q_offset, causal=False)
o1, s1 = chunked_prefill_attention(q, k[split:], v[split:], q_offset=q_offset - split, causal=True)
merged, lse = merge_states(torch.stack((o0, o1), dim=1), torch.stack((s0, s1), dim=1))

whole, whole_lse = chunked_prefill_attention(q, k, v)
print(f"backends usable here: {available_backends()}")
print(f"max |merged - unsharded| output: {(merged - whole).abs().max().item():.2e}")
print(f"max |merged - unsharded| LSE:    {(lse - whole_lse).abs().max().item():.2e}")
assert torch.allclose(merged, whole, atol=1e-5) and torch.allclose(lse, whole_lse, atol=1e-5)
