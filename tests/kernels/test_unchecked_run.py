"""``PagedAttentionPlan.unchecked_run``: the planned call itself, the same bits as ``run``."""

from __future__ import annotations

import pytest
import torch

from medha_kernels import KernelInputError, plan_paged_attention_from_host


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_unchecked_run_gives_runs_bits_and_skips_only_the_checks(backend: str) -> None:
    gen = torch.Generator().manual_seed(3)
    block, blocks, hq, hkv, d = 4, 12, 4, 2, 16
    # two decodes and a 3-token chunk over 9, 17 and 13 keys
    kv_lens, tables = [9, 17, 13], [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11]]
    plan = plan_paged_attention_from_host(
        cu_seqlens_q=[0, 1, 2, 5],
        kv_lens=kv_lens,
        block_tables=tables,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=block,
        dtype=torch.float32,
        causal=True,
        backend=backend,
    )
    run = plan.unchecked_run()
    for _layer in range(3):  # each layer its own query and cache
        q = torch.randn(5, hq, d, generator=gen)
        k = torch.randn(blocks, block, hkv, d, generator=gen)
        v = torch.randn(blocks, block, hkv, d, generator=gen)
        want = plan.run(q, k, v)
        got = run(q, k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(KernelInputError, match="q: the plan expects"):
        plan.run(q[:4], k, v)  # run still checks
