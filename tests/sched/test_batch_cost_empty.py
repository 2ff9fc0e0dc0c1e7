"""``BatchCost.empty()`` (a scheduler's drafts start from a kept empty batch) is
the batch ``BatchCost(model, num_groups, price=price)`` builds: every slot the
same, for aggregate models with and without a price, one group and several,
and a model priced on the whole batch."""

from __future__ import annotations

import pytest

from medha_sched.batch_cost import BatchCost
from medha_sched.cost.base import BatchWork, CostModel
from medha_sched.sim.runner import RunSpec


class _Whole(CostModel):
    """A model priced on the whole batch (no features)."""

    def predict(self, batch: BatchWork) -> float:
        return 1e-3 * sum(len(g) for g in batch.groups)


def _slots(cost: BatchCost) -> dict:
    return {name: getattr(cost, name) for name in BatchCost.__slots__}


def _roofline():
    spec = RunSpec(policy="lars-mp", cost_model="roofline:model=llama3-8b,gpu=a100", tp=8)
    return spec.build()[1]


@pytest.mark.parametrize(("groups", "priced"), [(1, True), (1, False), (2, True), (3, False)])
def test_empty_is_a_new_batch(groups: int, priced: bool) -> None:
    model = _roofline()
    price = model.chunk_price() if priced else None
    kept = BatchCost(model, groups, price=price)
    kept.add([(0, 64, 0, True)])  # the kept one's state is not copied
    got, want = kept.empty(), BatchCost(model, groups, price=price)
    assert _slots(got) == _slots(want)
    assert got._totals is not kept._totals and got._probes is not kept._probes
    assert got._items is not kept._items
    got.add([(0, 32, 0, True)])
    want.add([(0, 32, 0, True)])
    assert _slots(got) == _slots(want)


def test_empty_of_a_whole_batch_model() -> None:
    model = _Whole()
    kept = BatchCost(model, 2)
    got, want = kept.empty(), BatchCost(model, 2)
    assert _slots(got) == _slots(want) and got._agg is None
    got.add([(1, 8, 0, True)])
    assert got._items == [[], [got._items[1][0]]] and kept._items == [[], []]
