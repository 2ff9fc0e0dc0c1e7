"""Host-side step metadata: int32 block tables, the padded table, and KV writes skipped."""

from __future__ import annotations

from array import array

import torch

from medha_runtime.model import ForwardBatch
from medha_runtime.plan import BlockTables
from medha_runtime.runner import padded_table


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
