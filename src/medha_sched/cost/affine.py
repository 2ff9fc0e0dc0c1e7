"""A calibrated affine cost model: fixed cost + linear tokens + attended pairs.

Per KVP group, with the sums taken over the requests the group holds::

    time = base + per_token * (query tokens of tail items)
                + per_attn  * sum(q_tokens * kv_attended)

``kv_attended`` is ``kv_tokens + q_tokens`` on a request's tail group (the
chunk attends to the cached KV and to itself) and ``kv_tokens`` on the groups
that only attend. ``base`` is charged once per non-empty group.

The three constants are *calibrated*: they describe one replica of one
parallel layout, measured end to end. Tensor and stream-pipeline parallelism
do not change the formula; fit the constants for the layout you run (the
``layout`` field only records which one that is, and bounds the number of
KVP groups a batch may have).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from medha_sched.config import ParallelDegrees, _check_float
from medha_sched.cost.base import AggregateCostModel
from medha_sched.cost.registry import DEFAULT_LAYOUT, check_spec_keys, spec_float


@dataclass(frozen=True, kw_only=True, slots=True)
class AffineCostModel(AggregateCostModel):
    """``base + per_token * tail tokens + per_attn * attended pairs`` per group.

    Attributes:
        base: seconds charged once per non-empty group (> 0, so that any
            non-empty batch takes time).
        per_token: seconds per query token of a tail item (linear layers).
        per_attn: seconds per attended (query, key) pair.
        layout: the parallel layout the constants were calibrated for.
    """

    base: float
    per_token: float
    per_attn: float
    layout: ParallelDegrees = field(default_factory=ParallelDegrees)

    #: features: (tail query tokens, attended pairs)
    num_features: ClassVar[int] = 2
    affine_decode_features: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_float("base", self.base, minimum=0.0, strict=True)
        _check_float("per_token", self.per_token, minimum=0.0)
        _check_float("per_attn", self.per_attn, minimum=0.0)
        if not isinstance(self.layout, ParallelDegrees):
            raise ValueError(f"layout must be a ParallelDegrees, got {self.layout!r}")

    def features(self, q_tokens: int, kv_tokens: int, tail: bool) -> tuple[float, ...]:
        """``(tail query tokens, q * kv_attended)`` of one request."""
        if tail:
            return (q_tokens, q_tokens * (kv_tokens + q_tokens))
        return (0, q_tokens * kv_tokens)

    def group_time(self, totals: Sequence[float]) -> float:
        """``base + per_token * totals[0] + per_attn * totals[1]``."""
        return self.base + self.per_token * totals[0] + self.per_attn * totals[1]

    @classmethod
    def from_spec(
        cls, params: Mapping[str, str], *, layout: ParallelDegrees = DEFAULT_LAYOUT
    ) -> AffineCostModel:
        """Build from ``affine:base=S,per_token=S,per_attn=S`` parameters."""
        keys = ("base", "per_token", "per_attn")
        check_spec_keys("affine", params, required=keys)
        values = {k: spec_float("affine", params, k) for k in keys}
        return cls(**values, layout=layout)
