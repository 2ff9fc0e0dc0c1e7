"""Host-side step metadata: int32 block tables, the padded table, and KV writes skipped."""

from __future__ import annotations

from array import array

import pytest
import torch

from medha_kernels.plan import padded_block_table as padded_table
from medha_runtime.model import ForwardBatch
from medha_runtime.plan import BlockTables


def test_block_tables_are_int32_arrays_that_grow_by_deltas() -> None:
    tables = BlockTables()
    tables.extend("a", ((0, (3, 1)), (1, (8,))))
    tables.extend("a", ((0, (5,)),))
    got = tables.blocks("a", 0)
    assert isinstance(got, array) and got.typecode == "i"
    assert list(got) == [3, 1, 5] and list(tables.blocks("a", 1)) == [8]
    assert len(tables.blocks("a", 2)) == 0 and len(tables.blocks("b", 0)) == 0
    tables.drop(["a"])
    assert "a" not in tables and len(tables.blocks("a", 0)) == 0


def test_padded_table_pads_arrays_and_lists_with_zeros() -> None:
    rows = [array("i", [4, 5, 6]), [7], array("i"), (9, 2)]
    table = padded_table(rows)
    assert table.dtype == torch.int32
    assert table.tolist() == [[4, 5, 6], [7, 0, 0], [0, 0, 0], [9, 2, 0]]
    assert padded_table([array("i"), []]).shape == (2, 0)
    assert padded_table([]).shape == (0, 0)


def _batch(slots: list[int], writes_kv: bool) -> ForwardBatch:
    n = len(slots)
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.arange(n),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        kv_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.zeros((1, 1), dtype=torch.int32),
        slots=torch.tensor(slots, dtype=torch.int32),
        sample_rows=torch.tensor([n - 1]),
        writes_kv=writes_kv,
    )


def test_write_kv_skipped_only_when_the_host_says_nothing_is_written() -> None:
    k, v = torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    kc, vc = torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)
    skip = _batch([-1, -1], writes_kv=False)
    for _ in range(2):  # the first layer's write and the later ones
        skip.write_kv(k, v, kc, vc)
    assert not kc.any() and not vc.any()
    assert skip.to("cpu").writes_kv is False
    write = _batch([-1, 5], writes_kv=True)
    for _ in range(2):
        write.write_kv(k, v, kc, vc)
    assert torch.equal(kc[1, 1], k[1]) and torch.equal(vc[1, 1], v[1])
    assert int((kc != 0).sum()) == 4  # one slot of one head: the padding token wrote nothing


def test_prepare_kv_write_writes_what_the_checked_first_write_writes() -> None:
    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = [6, -1, 1]
    caches = []
    for prepare in (False, True):
        kc, vc = torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4)
        batch = _batch(slots, writes_kv=True)
        if prepare:
            batch.prepare_kv_write(kc)
            batch.prepare_kv_write(kc)  # a no-op once prepared
        for _ in range(2):  # the first layer's write and a later one
            batch.write_kv(k, v, kc, vc)
        caches.append((kc, vc))
    (kc0, vc0), (kc1, vc1) = caches
    assert torch.equal(kc0, kc1) and torch.equal(vc0, vc1)
    assert torch.equal(kc1[1, 2], k[0]) and torch.equal(vc1[0, 1], v[2])
    assert int((kc1 != 0).sum()) == 2 * 2 * 4  # the padding token wrote nothing


def test_prepare_kv_write_rejects_bad_slots() -> None:
    kc = torch.zeros(2, 4, 1, 4)
    with pytest.raises(ValueError, match="8 is past the cache's 8 slots"):
        _batch([1, 8], writes_kv=True).prepare_kv_write(kc)
    bad = _batch([1, 2], writes_kv=True)
    bad.slots = bad.slots.long()
    with pytest.raises(ValueError, match=r"want \[2\] int32, got \[2\] torch.int64"):
        bad.prepare_kv_write(kc)
    skip = _batch([9, 9], writes_kv=False)
    skip.prepare_kv_write(kc)  # nothing is written: nothing to check
    skip.write_kv(torch.ones(2, 1, 4), torch.ones(2, 1, 4), kc, kc.clone())
    assert not kc.any()


def _sharded(plan_chunks, group: int):
    """Group ``group``'s batch, shards and attention hook for a kvp=2 step (8-token shards)."""
    from medha_runtime.plan import PlannedChunk, StepPlan
    from medha_runtime.runner import ShardedAttention, build_group_batch

    tables = BlockTables()
    chunks = []
    for rid, start, n, groups, blocks in plan_chunks:
        tables.extend(rid, blocks)
        chunks.append(PlannedChunk(rid, start, tuple(range(n)), groups))
    batch, shards = build_group_batch(
        StepPlan(0, tuple(chunks)),
        tables,
        group=group,
        kvp=2,
        group_tokens=8,
        block_size=4,
        device="cpu",
    )
    hook = ShardedAttention(comm=None)  # type: ignore[arg-type]  # planning only
    hook.prepare(shards)
    return batch, shards, hook


def test_sharded_attention_takes_the_batch_plan_only_where_it_is_the_same_call() -> None:
    from medha_parallel.kvp import plan_kvp_attention

    shapes = {"num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
    # a: decode at 13 (shard 0 full on group 0, tail on group 1); b: a 3-token chunk
    # at 9 (tail on group 1); c: a 5-token chunk at 10 (shard 0 on group 0, full)
    a = ("a", 13, 1, (0, 1), ((0, (0, 1)), (1, (5, 6))))
    b = ("b", 9, 3, (0, 1), ((0, (2, 3)), (1, (7,))))
    c = ("c", 10, 5, (0, 1), ((0, (8, 9)), (1, (10, 11))))
    kc, vc = torch.randn(12, 4, 2, 8), torch.randn(12, 4, 2, 8)
    cases = {(("a", "b"), 0): False, (("a", "b"), 1): True, (("a",), 0): True}
    cases |= {(("a", "c"), 1): True, (("a", "c"), 0): False}  # c: a full shard, many rows
    chunks = {"a": a, "b": b, "c": c}
    for (names, group), same in cases.items():
        batch, shards, hook = _sharded([chunks[n] for n in names], group)
        q = torch.randn(sum(shards.num_q), 4, 8)
        got = hook._batch_plan(q, kc, batch)
        if not same:
            assert got is None, (names, group)
            continue
        assert got is not None and got.parts[0].rows is None, (names, group)
        want = plan_kvp_attention(**shards._asdict(), **shapes)
        for x, y in zip(got.partial(q, kc, vc), want.partial(q, kc, vc), strict=True):
            assert torch.equal(x, y), (names, group)


def test_group_batch_with_capacity_keeps_the_write_index_prepare_would() -> None:
    """``build_group_batch(capacity=...)``: where every row writes its K/V on this group,
    the int64 write index comes from the host list, equal to what
    ``prepare_kv_write`` keeps; a slot past the capacity is refused by name."""
    from medha_runtime.plan import PlannedChunk, StepPlan
    from medha_runtime.runner import build_group_batch

    tables = BlockTables()
    tables.extend("a", ((0, (0, 1)), (1, (5, 6))))
    tables.extend("b", ((0, (2, 3)), (1, (7,))))
    # a: decode at 13 (tail on group 1); b: a 3-token chunk at 9 (tail on group 1)
    step = StepPlan(
        0, (PlannedChunk("a", 13, (1,), (0, 1)), PlannedChunk("b", 9, (1, 2, 3), (0, 1)))
    )
    kw = {"kvp": 2, "group_tokens": 8, "block_size": 4, "device": "cpu"}
    kc = torch.zeros(8, 4, 2, 8)
    tail, _ = build_group_batch(step, tables, group=1, capacity=32, **kw)
    plain, _ = build_group_batch(step, tables, group=1, **kw)
    assert tail._kv_write is not None and plain._kv_write is None
    plain.prepare_kv_write(kc)
    assert plain._kv_write is not None
    idx, rows = tail._kv_write
    assert rows is None and idx.dtype == torch.int64
    assert torch.equal(idx, plain._kv_write[0]) and plain._kv_write[1] is None
    assert idx.tolist() == [6 * 4 + 1, 7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3]
    # group 0 holds neither tail: nothing written, nothing kept
    head, _ = build_group_batch(step, tables, group=0, capacity=32, **kw)
    assert not head.writes_kv and head._kv_write is None
    with pytest.raises(ValueError, match="31 is past the cache's 30 slots"):
        build_group_batch(step, tables, group=1, capacity=30, **kw)


def test_group_batch_tensors_are_the_lists_as_forward_batch_builds_them() -> None:
    """``build_group_batch`` makes its index tensors through arrays: the same values and
    dtypes as :meth:`ForwardBatch.build`'s ``torch.tensor`` for a kvp=1 step (a prefill
    chunk, two decodes, one not sampled), and empty tensors where a list is empty."""
    from medha_runtime.plan import PlannedChunk, StepPlan
    from medha_runtime.runner import build_group_batch
    from medha_runtime.sampling_params import SampleSpec

    tables = BlockTables()
    blocks = {"a": (3, 0, 9), "b": (4,), "c": (7, 1)}
    for rid, ids in blocks.items():
        tables.extend(rid, ((0, ids),))
    greedy = SampleSpec("x", 0.0, 0, 1.0, 0, None)
    chunks = (
        PlannedChunk("a", 4, (11, 12, 13, 14, 15), (0,), (), greedy),
        PlannedChunk("b", 2, (21,), (0,), (), None),
        PlannedChunk("c", 5, (31,), (0,), (), greedy),
    )
    got, _ = build_group_batch(
        StepPlan(0, chunks), tables, group=0, kvp=1, group_tokens=64, block_size=4, device="cpu"
    )
    want = ForwardBatch.build(
        [c.token_ids for c in chunks],
        [c.start for c in chunks],
        [blocks[c.request_id] for c in chunks],
        block_size=4,
        sample=[c.sample is not None for c in chunks],
    )
    for name in ("input_ids", "positions", "cu_seqlens_q", "kv_lens", "slots", "sample_rows"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.host.cu_seqlens_q == [0, 5, 6, 7] and got.host.max_block == 9
    # nothing sampled: an empty int64 sample_rows
    quiet = tuple(c._replace(sample=None) for c in chunks)
    none, _ = build_group_batch(
        StepPlan(0, quiet), tables, group=0, kvp=1, group_tokens=64, block_size=4, device="cpu"
    )
    assert none.sample_rows.dtype == torch.int64 and none.sample_rows.shape == (0,)


def test_batch_attention_checks_the_first_call_and_runs_the_later_ones_unchecked(
    monkeypatch,
) -> None:
    """``ForwardBatch.attention``: the step's first layer runs the plan checked (a wrong
    shape raises), the later ones the same plan unchecked, with the same results as the
    checked run; another backend is planned and checked afresh."""
    from medha_kernels import KernelInputError, PagedAttentionPlan

    batch = ForwardBatch.build([[1, 2, 3], [4]], [0, 6], [[0, 1], [3, 2]], block_size=4)
    kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    qs = [torch.randn(4, 4, 8) for _ in range(3)]
    with pytest.raises(KernelInputError):  # the first call checks
        batch.attention(qs[0], kc, torch.randn(4, 4, 2, 4))
    checked = []
    run = PagedAttentionPlan.run

    def counting(self, *args):
        checked.append(self.backend)
        return run(self, *args)

    monkeypatch.setattr(PagedAttentionPlan, "run", counting)
    got = [batch.attention(q, kc, vc) for q in qs]
    assert len(checked) == 1  # the first layer only
    plan = batch.attention_plan_for(qs[0], kc)
    for q, (o, lse) in zip(qs, got, strict=True):
        want_o, want_lse = run(plan, q, kc, vc)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    batch.attention(qs[0], kc, vc, backend="torch")
    assert checked[1:] == ["torch"]
    with pytest.raises(KernelInputError):  # and checks the first call of that backend
        ForwardBatch.build([[4]], [6], [[3, 2]], block_size=4).attention(
            torch.randn(1, 4, 8), kc, torch.randn(4, 4, 2, 4), backend="torch"
        )
