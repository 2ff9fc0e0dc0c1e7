"""plan_paged_attention_from_host: host lists plan as tensors do, with no device read."""

from __future__ import annotations

import pytest
import torch

from medha_kernels import KernelInputError, plan_paged_attention, plan_paged_attention_from_host

SHAPES = {"num_qo_heads": 6, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}


def _host_batch() -> tuple[list[int], list[int], list[list[int]]]:
    """Decodes, a chunk, a zero-query and an empty sequence; tables longer than needed."""
    cu = [0, 1, 9, 9, 10, 10]
    lens = [5, 12, 3, 1, 0]
    tables = [[7, 2, 99], [0, 4, 8], [5], [11, 1], []]
    return cu, lens, tables


@pytest.mark.parametrize("causal", [True, False])
def test_host_plan_equals_tensor_plan(monkeypatch, causal) -> None:
    cu, lens, tables = _host_batch()
    width = 3
    table = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables])
    ref = plan_paged_attention(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        kv_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=table.to(torch.int32),
        causal=causal,
        **SHAPES,
    )

    def no_read(*args, **kwargs):
        raise AssertionError("host read while planning from host lists")

    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    monkeypatch.setattr(torch.Tensor, "item", no_read)
    plan = plan_paged_attention_from_host(
        cu_seqlens_q=cu, kv_lens=lens, block_tables=tables, causal=causal, **SHAPES
    )
    monkeypatch.undo()
    assert plan.backend == ref.backend
    assert plan.meta.max_block == ref.meta.max_block == 11  # block 99 lies past kv_lens[0]
    q = torch.randn(cu[-1], 6, 16)
    kc, vc = torch.randn(12, 4, 2, 16), torch.randn(12, 4, 2, 16)
    for got, want in zip(plan.run(q, kc, vc), ref.run(q, kc, vc), strict=True):
        assert torch.equal(got, want)


def test_host_plan_refuses_bad_lists() -> None:
    cu, lens, tables = _host_batch()
    with pytest.raises(KernelInputError, match="4 rows for 5 sequences"):
        plan_paged_attention_from_host(
            cu_seqlens_q=cu, kv_lens=lens, block_tables=tables[:4], **SHAPES
        )
    with pytest.raises(KernelInputError, match=r"kv_lens\[1\]=12 needs 3 blocks, got 2"):
        bad = [tables[0], [0, 4], *tables[2:]]
        plan_paged_attention_from_host(cu_seqlens_q=cu, kv_lens=lens, block_tables=bad, **SHAPES)
    with pytest.raises(KernelInputError, match="block id -3 is negative"):
        bad = [[7, -3], *tables[1:]]
        plan_paged_attention_from_host(cu_seqlens_q=cu, kv_lens=lens, block_tables=bad, **SHAPES)
    with pytest.raises(KernelInputError, match=r"kv_lens\[1\]=7 is below its 8 queries"):
        plan_paged_attention_from_host(
            cu_seqlens_q=cu, kv_lens=[5, 7, 3, 1, 0], block_tables=tables, **SHAPES
        )


def test_tensor_plan_with_host_copies_reads_nothing_back(monkeypatch) -> None:
    """``plan_paged_attention(..., host=PagedHost(...))``: the tensors' own plan, built
    without a device read; host lists that do not match the tensors' sizes are refused."""
    from medha_kernels import PagedHost

    cu, lens, tables = _host_batch()
    width = 3
    rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
    tensors = {
        "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32),
        "kv_lens": torch.tensor(lens, dtype=torch.int32),
        "block_table": torch.tensor(rows, dtype=torch.int32),
    }
    ref = plan_paged_attention(**tensors, **SHAPES)

    def no_read(*args, **kwargs):
        raise AssertionError("host read while planning with host copies")

    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    monkeypatch.setattr(torch.Tensor, "item", no_read)
    monkeypatch.setattr(torch.Tensor, "__int__", no_read)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_read)
    host = PagedHost(cu_seqlens_q=cu, kv_lens=lens, max_block=ref.meta.max_block)
    plan = plan_paged_attention(**tensors, **SHAPES, host=host)
    monkeypatch.undo()
    assert (plan.meta.cu, plan.meta.lens, plan.meta.max_block) == (cu, lens, 11)
    q = torch.randn(cu[-1], 6, 16)
    kc, vc = torch.randn(12, 4, 2, 16), torch.randn(12, 4, 2, 16)
    for got, want in zip(plan.run(q, kc, vc), ref.run(q, kc, vc), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(KernelInputError, match=r"host: 5 offsets and 5 lengths for tensors"):
        short = PagedHost(cu_seqlens_q=cu[:5], kv_lens=lens, max_block=11)
        plan_paged_attention(**tensors, **SHAPES, host=short)
    with pytest.raises(KernelInputError, match=r"kv_lens\[1\]=12 is below its 13 queries"):
        wrong = PagedHost(cu_seqlens_q=[0, 1, 14, 14, 15, 15], kv_lens=lens, max_block=11)
        plan_paged_attention(**tensors, **SHAPES, host=wrong)


def test_host_plan_takes_int32_arrays() -> None:
    """Rows as ``array('i')`` (the runner's block tables) plan exactly as lists do; a
    negative id in use is refused either way, one past ``kv_lens`` is ignored."""
    from array import array

    cu, lens, tables = _host_batch()
    ref = plan_paged_attention_from_host(
        cu_seqlens_q=cu, kv_lens=lens, block_tables=tables, **SHAPES
    )
    rows = [array("i", t) for t in tables]
    plan = plan_paged_attention_from_host(
        cu_seqlens_q=cu, kv_lens=lens, block_tables=rows, **SHAPES
    )
    assert torch.equal(plan.meta.block_table, ref.meta.block_table)
    assert plan.meta.max_block == ref.meta.max_block == 11
    q = torch.randn(cu[-1], 6, 16)
    kc, vc = torch.randn(12, 4, 2, 16), torch.randn(12, 4, 2, 16)
    for got, want in zip(plan.run(q, kc, vc), ref.run(q, kc, vc), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(KernelInputError, match="block id -3 is negative"):
        bad = [array("i", [7, -3]), *rows[1:]]
        plan_paged_attention_from_host(cu_seqlens_q=cu, kv_lens=lens, block_tables=bad, **SHAPES)
    past = [array("i", [7, 2, -5]), *rows[1:]]  # -5 lies past kv_lens[0]: not in use
    plan = plan_paged_attention_from_host(
        cu_seqlens_q=cu, kv_lens=lens, block_tables=past, **SHAPES
    )
    assert plan.meta.max_block == 11
