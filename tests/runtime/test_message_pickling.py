"""``StepPlan``, ``Step`` and ``Done`` pickle through their constructors with
hand-listed fields (``__reduce__``, for speed): a field added later and left out of
that list would reach the workers as its default. These tests fail then."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from medha_runtime.messages import Done, Step
from medha_runtime.plan import PlannedChunk, StepPlan


def _plan() -> StepPlan:
    chunk = PlannedChunk("r1", 5, (7, 8), (0,), ((0, (3, 4)),))
    return StepPlan(9, (chunk,), free=("a",), finished=("b",), release_after=("c",))


@pytest.mark.parametrize(
    "obj",
    [
        _plan(),
        Step(_plan()),
        Done(rank=2, step_id=9, result=[1, 2], compute_s=0.5, cpu_s=0.25, wait_s=0.125),
    ],
    ids=["StepPlan", "Step", "Done"],
)
def test_every_field_travels(obj) -> None:
    cls, args = obj.__reduce__()
    assert cls is type(obj)
    assert len(args) == len(dataclasses.fields(obj))  # every field listed
    back = pickle.loads(pickle.dumps(obj))
    assert back == obj
    for f in dataclasses.fields(obj):  # none left at a default by the round trip
        assert getattr(back, f.name) == getattr(obj, f.name)
