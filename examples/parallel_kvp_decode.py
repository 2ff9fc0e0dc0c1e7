"""KV-cache parallel decode on two CPU processes with medha_parallel.

Each process is one KVP group holding half of a sequence's KV cache. Both get
the same decode query, attend to their own shard (the tail shard causally,
the earlier one in full), and ``KVPCommunicator.merge`` combines the partial
states exactly. Rank 0 then checks the result against attention over the
whole cache computed in one process.

    python examples/parallel_kvp_decode.py
"""

from __future__ import annotations

import tempfile

import torch
import torch.multiprocessing as mp

from medha_kernels import chunked_prefill_attention
from medha_parallel import KVPCommunicator, ParallelLayout, ParallelState, kvp_attention

CONTEXT, SHARD, HEADS, KV_HEADS, HEAD_DIM = 4096, 2048, 8, 2, 64


def worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    state = ParallelState.initialize(  # CPU ranks (gloo), on a CUDA machine too
        ParallelLayout(kvp=2),
        device="cpu",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
    )
    g = torch.Generator().manual_seed(0)  # every rank draws the same sequence
    q = torch.randn(1, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(CONTEXT, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(CONTEXT, KV_HEADS, HEAD_DIM, generator=g)
    lo, hi = rank * SHARD, (rank + 1) * SHARD  # this group's shard of the sequence
    out, lse = kvp_attention(q, k[lo:hi], v[lo:hi], comm=KVPCommunicator(state), active=2)
    if rank == 0:
        whole, whole_lse = chunked_prefill_attention(q, k, v)
        err = (out - whole).abs().max().item()
        print(f"KVP2 decode over {CONTEXT} tokens: max |merged - single process| = {err:.2e}")
        assert err < 1e-5 and torch.allclose(lse, whole_lse, atol=1e-5)
    state.destroy()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            worker, args=(f"{tmp}/init",), nprocs=2, join=True, start_method="forkserver"
        )
