"""Monotone cost models for property tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from medha_sched.config import ParallelDegrees
from medha_sched.cost.base import AggregateCostModel

DEFAULT_LAYOUT = ParallelDegrees()


@dataclass(frozen=True, kw_only=True)
class PolyCostModel(AggregateCostModel):
    """base + a*q_tail + b*attn + c*kv + d*q_tail**2 + e*q_nontail per group (all >= 0)."""

    base: float
    a: float
    b: float
    c: float
    d: float
    e: float
    layout: ParallelDegrees = DEFAULT_LAYOUT
    num_features: int = 4

    def features(self, q_tokens: int, kv_tokens: int, tail: bool) -> tuple[float, ...]:
        if tail:
            return (q_tokens, q_tokens * (kv_tokens + q_tokens), kv_tokens, 0.0)
        return (0.0, q_tokens * kv_tokens, kv_tokens, q_tokens)

    def group_time(self, totals: Sequence[float]) -> float:
        q, attn, kv, q_other = totals
        return (
            self.base + self.a * q + self.b * attn + self.c * kv + self.d * q * q + self.e * q_other
        )


def poly_models(layout: ParallelDegrees = DEFAULT_LAYOUT) -> st.SearchStrategy[PolyCostModel]:
    coef = st.floats(min_value=0.0, max_value=1.0)
    return st.builds(
        PolyCostModel,
        base=st.floats(min_value=1e-4, max_value=5e-3),
        a=coef.map(lambda x: x * 1e-4),
        b=coef.map(lambda x: x * 1e-8),
        c=coef.map(lambda x: x * 1e-7),
        d=coef.map(lambda x: x * 1e-9),
        e=coef.map(lambda x: x * 1e-6),
        layout=st.just(layout),
    )
