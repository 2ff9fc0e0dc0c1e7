"""Input validation and backend dispatch: clear errors naming the tensor and the shape."""

from __future__ import annotations

import logging

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


def test_an_explicit_backend_is_refused_for_inputs_its_can_run_declines() -> None:
    """``native`` attention runs on CPU tensors only: asked for it with a query on
    another device (found on a GPU, where its planner failed deep inside the C++
    extension), resolution names the backend and the usable ones instead."""
    from medha_kernels.backends import resolve_name

    cpu = torch.device("cpu")
    off_cpu = (torch.empty(2, 4, 8, device="meta"),)
    with pytest.raises(
        ValueError, match=r"backend 'native' cannot run paged_attention on these cpu inputs .* "
        r"usable here: torch"
    ):  # fmt: skip
        resolve_name("paged_attention", "native", cpu, off_cpu)
    assert resolve_name("paged_attention", "native", cpu, (torch.empty(2, 4, 8),)) == "native"
    assert resolve_name("merge_state", "native", cpu, off_cpu) == "native"  # merges anywhere


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
