"""The native backend's planned call: the op itself with the plan's arguments bound.

``PagedAttentionPlan.unchecked_run()`` on the native backend is a ``functools.partial``
of ``paged_attention_planned`` (no Python frame per layer); it makes q and the caches
contiguous in C++, so a strided query gives the bits of its contiguous copy, and the
same bits as ``paged_attention`` with the same arguments.
"""

from __future__ import annotations

import functools

import pytest
import torch

from medha_kernels import native, plan_paged_attention_from_host

pytestmark = pytest.mark.skipif(
    not native.supports_device(torch.device("cpu")), reason="no C++ toolchain"
)


def test_planned_run_is_the_op_and_makes_its_inputs_contiguous() -> None:
    gen = torch.Generator().manual_seed(5)
    block, blocks, hq, hkv, d = 4, 9, 6, 2, 16
    plan = plan_paged_attention_from_host(
        cu_seqlens_q=[0, 1, 4],  # a decode over 11 keys, a 3-token chunk over 21
        kv_lens=[11, 21],
        block_tables=[[0, 1, 2], [3, 4, 5, 6, 7, 8]],
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=block,
        dtype=torch.float32,
        causal=True,
        backend="native",
    )
    run = plan.unchecked_run()
    ext = native.get_module("cpu")
    assert isinstance(run, functools.partial) and run.func is ext.paged_attention_planned
    q = torch.randn(4, hq, d, generator=gen)
    k = torch.randn(blocks, block, hkv, d, generator=gen)
    v = torch.randn(blocks, block, hkv, d, generator=gen)
    want = ext.paged_attention(q, k, v, *run.args)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # q's values, not contiguous
    assert not strided.is_contiguous()
    for got in (run(q, k, v), run(strided, k, v), plan.run(strided, k, v)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="k_cache/v_cache"):
        run(q, k[..., :8], v)  # the op's own checks stay
