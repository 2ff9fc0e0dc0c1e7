"""Input validation and backend dispatch: clear errors naming the tensor and the shape."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import medha_kernels as mk
from medha_kernels import KernelInputError


def qkv(num_q=4, hq=4, hk=2, d=16, num_kv=8, dtype=torch.float32):
    return (
        torch.randn(num_q, hq, d).to(dtype),
        torch.randn(num_kv, hk, d).to(dtype),
        torch.randn(num_kv, hk, d).to(dtype),
    )


def test_wrong_rank_names_the_tensor_and_layout() -> None:
    q, k, v = qkv()
    with pytest.raises(KernelInputError, match=r"q: expected a 3-D tensor \[num_q, num_qo_heads"):
        mk.chunked_prefill_attention(q[0], k, v)
    with pytest.raises(
        KernelInputError, match=r"s: expected a 2-D tensor \[num_tokens, num_heads\]"
    ):
        mk.merge_state(q, torch.zeros(4), q, torch.zeros(4, 4))


def test_wrong_dtype_head_ratio_and_head_dim() -> None:
    q, k, v = qkv()
    with pytest.raises(KernelInputError, match=r"k: expected dtype float32, got torch\.float16"):
        mk.chunked_prefill_attention(q, k.half(), v)
    with pytest.raises(
        KernelInputError, match="num_qo_heads=4 must be a positive multiple of num_kv_heads=3"
    ):
        mk.chunked_prefill_attention(q, torch.randn(8, 3, 16), torch.randn(8, 3, 16))
    with pytest.raises(KernelInputError, match="head_dim 8 differs from q's 16"):
        mk.chunked_prefill_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(KernelInputError, match=r"s: expected dtype float32, got torch\.float16"):
        mk.merge_state(q, torch.zeros(4, 4).half(), q, torch.zeros(4, 4))
    with pytest.raises(KernelInputError, match=r"b: v: expected shape \(4, 4, 16\)"):
        mk.merge_state(q, torch.zeros(4, 4), q[:2], torch.zeros(2, 4))


def test_paged_index_errors() -> None:
    q = torch.randn(3, 4, 16)
    cache = torch.randn(4, 8, 2, 16)
    ok = dict(
        cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
        kv_lens=torch.tensor([5, 9], dtype=torch.int32),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
    )
    mk.paged_attention(q, cache, cache, **ok)
    with pytest.raises(KernelInputError, match=r"kv_lens: expected dtype int32, got torch\.int64"):
        mk.paged_attention(q, cache, cache, **{**ok, "kv_lens": ok["kv_lens"].long()})
    with pytest.raises(KernelInputError, match="cu_seqlens_q must rise from 0 to num_q=3"):
        mk.paged_attention(
            q, cache, cache, **{**ok, "cu_seqlens_q": torch.tensor([0, 2, 1], dtype=torch.int32)}
        )
    with pytest.raises(KernelInputError, match=r"kv_lens\[0\]=0 is below its 1 queries"):
        mk.paged_attention(
            q, cache, cache, **{**ok, "kv_lens": torch.tensor([0, 9], dtype=torch.int32)}
        )
    with pytest.raises(
        KernelInputError, match=r"kv_lens\[1\]=17 needs more blocks than block_table's 2"
    ):
        mk.paged_attention(
            q, cache, cache, **{**ok, "kv_lens": torch.tensor([5, 17], dtype=torch.int32)}
        )


def test_append_errors() -> None:
    k = torch.randn(2, 2, 16)
    cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(KernelInputError, match="slots: 8 is past the cache's 8 slots"):
        mk.append_paged_kv(k, k, cache, cache, slots=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(KernelInputError, match=r"slots: expected shape \(2,\)"):
        mk.append_paged_kv(k, k, cache, cache, slots=torch.tensor([0], dtype=torch.int32))


def test_native_attention_refuses_inputs_off_the_cpu_by_name() -> None:
    """Asked for explicitly on a GPU (the benchmark did, on the H200), the native
    attention named the problem deep inside its C++ planner ("cu_seqlens_q: expected a
    contiguous int32 CPU tensor"); it now refuses the device first."""
    import types

    from medha_kernels._checks import KernelInputError
    from medha_kernels.native import attention as native

    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    want = r"native plan_paged_attention runs on the CPU only; the inputs are on cuda:0"
    with pytest.raises(KernelInputError, match=want):
        native.plan_paged_attention(on_gpu)
    q = torch.empty(2, 4, 8, device="meta")
    with pytest.raises(KernelInputError, match="native paged_attention runs on the CPU only"):
        native.paged_attention(q, q, q, q, q, q, True, 1.0)
    with pytest.raises(KernelInputError, match="native chunked_prefill_attention runs on the CPU"):
        native.chunked_prefill_attention(q, q, q, 0, True, 1.0)


def test_backend_selection_errors_and_auto_logging(caplog) -> None:
    q, k, v = qkv()
    assert "torch" in mk.available_backends("cpu")
    assert "flashinfer" not in mk.available_backends("cpu")
    with pytest.raises(
        ValueError, match="unknown backend 'cudnn'; known: torch, triton, native, flashinfer"
    ):
        mk.chunked_prefill_attention(q, k, v, backend="cudnn")
    with pytest.raises(
        ValueError, match="backend 'flashinfer' cannot run chunked_prefill_attention on cpu"
    ):
        mk.chunked_prefill_attention(q, k, v, backend="flashinfer")
    with caplog.at_level(logging.DEBUG, logger="medha_kernels"):
        mk.chunked_prefill_attention(q, k, v)
    assert any(
        "auto backend for chunked_prefill_attention on cpu" in r.message for r in caplog.records
    )


def test_defaults_q_offset_and_sm_scale() -> None:
    q, k, v = qkv()
    o1, l1 = mk.chunked_prefill_attention(q, k, v, backend="torch")
    o2, l2 = mk.chunked_prefill_attention(q, k, v, q_offset=4, sm_scale=16**-0.5, backend="torch")
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    o3, _ = mk.chunked_prefill_attention(q, k, v, sm_scale=0.5, backend="torch")
    assert not torch.allclose(o1, o3)


def test_zero_heads_head_dim_or_block_size_are_refused_by_name() -> None:
    """These reached the user as a ZeroDivisionError (head_dim 0 in the default scale,
    block_size 0 in the host planner) or the native planner's RuntimeError (no query
    heads) instead of a KernelInputError naming the value."""
    host = dict(cu_seqlens_q=[0, 1], kv_lens=[1], block_tables=[[0]], head_dim=16)
    with pytest.raises(KernelInputError, match="block_size must be >= 1, got 0"):
        mk.plan_paged_attention_from_host(num_qo_heads=4, num_kv_heads=2, block_size=0, **host)
    with pytest.raises(
        KernelInputError, match="num_qo_heads=0 must be a positive multiple of num_kv_heads=2"
    ):
        mk.plan_paged_attention_from_host(num_qo_heads=0, num_kv_heads=2, block_size=4, **host)
    with pytest.raises(KernelInputError, match=r"q: head_dim must be >= 1, got shape \(2, 2, 0\)"):
        mk.chunked_prefill_attention(
            torch.randn(2, 2, 0), torch.randn(3, 2, 0), torch.randn(3, 2, 0)
        )


def test_q_offset_must_be_an_integer() -> None:
    """``q_offset=1.7`` was truncated to 1 without a word; an integer of any kind (numpy's,
    a 0-d integer tensor) is still taken, and gives what the plain int gives."""
    q, k, v = torch.randn(2, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    for bad in (1.7, 2.0, True, "2"):
        with pytest.raises(KernelInputError, match=f"q_offset must be an integer, got {bad!r}"):
            mk.chunked_prefill_attention(q, k, v, q_offset=bad, backend="torch")
    want = mk.chunked_prefill_attention(q, k, v, q_offset=2, backend="torch")
    for same in (np.int64(2), torch.tensor(2)):
        got = mk.chunked_prefill_attention(q, k, v, q_offset=same, backend="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
