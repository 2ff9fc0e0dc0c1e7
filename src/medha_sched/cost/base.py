"""The cost-model contract: predict one iteration's time from plain numbers.

A batch is described per KVP group. Each group lists the requests whose KV it
holds, with the request's new query tokens (the chunk, replicated to every
active group) and the KV tokens that group already caches for it. The *tail*
group of a request is the one that appends the chunk's new KV and runs causal
attention over it; the request's linear layers (QKV, MLP, logits) are charged
to its tail group. Earlier groups run non-causal attention over their shard
and send back a partial (output, LSE) to be merged.

``predict`` returns the latency, in seconds, of the batch through the whole
replica: every pipeline stage, every group, and the merges. With SPP depth
``s`` a stage is busy for ``predict(batch) / s`` of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol, runtime_checkable

from medha_sched.config import ParallelDegrees


@dataclass(frozen=True, slots=True)
class RequestWork:
    """One request's share of an iteration on one KVP group.

    Attributes:
        q_tokens: new query tokens (>= 1): 1 for a decode, the chunk for a prefill.
        kv_tokens: KV tokens this group caches for the request before the chunk.
        tail: True on the group that appends the chunk's KV (and runs the
            request's linear layers); False on groups that only attend.
    """

    q_tokens: int
    kv_tokens: int
    tail: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.q_tokens, int) or self.q_tokens < 1:
            raise ValueError(f"q_tokens must be an integer >= 1, got {self.q_tokens!r}")
        if not isinstance(self.kv_tokens, int) or self.kv_tokens < 0:
            raise ValueError(f"kv_tokens must be an integer >= 0, got {self.kv_tokens!r}")


@dataclass(frozen=True, slots=True)
class BatchWork:
    """One iteration: ``groups[g]`` is the work on KVP group ``g``."""

    groups: tuple[tuple[RequestWork, ...], ...]

    @classmethod
    def single_group(cls, *items: tuple[int, int]) -> BatchWork:
        """A batch on one group from ``(q_tokens, kv_tokens)`` pairs, all tail."""
        return cls(groups=(tuple(RequestWork(q, kv) for q, kv in items),))


@runtime_checkable
class CostModel(Protocol):
    """Anything that predicts an iteration's latency in seconds.

    A model whose predictions change while it is used (one that learns) also
    has an integer ``revision`` that grows whenever they change materially;
    what is derived from its predictions is rebuilt then. A fixed model need
    not have one (it counts as revision 0).
    """

    layout: ParallelDegrees

    def predict(self, batch: BatchWork) -> float:
        """Latency in seconds of ``batch`` through the whole replica (>= 0)."""
        ...


class AggregateCostModel(ABC):
    """A cost model whose group time depends on additive per-request features.

    Subclasses say how one request maps to a feature vector and how a group's
    summed features map to time. The batch packer uses this to price a
    candidate chunk in O(1) instead of re-reading the whole batch; ``predict``
    is the same computation done from scratch, and the two always agree.
    Every subclass must be monotone: more query or KV tokens never predicts
    less time.
    """

    layout: ParallelDegrees

    #: length of the vector ``features`` returns
    num_features: int

    #: True when a one-token work's features are integers (given integer
    #: arguments) and, on the tail group, affine in the KV length:
    #: ``features(1, kv, True) == A + kv * B`` exactly. The scheduler then
    #: prices a set of running decodes from their count and summed positions
    #: in O(1), with the very integers a one-by-one sum gives.
    affine_decode_features: ClassVar[bool] = False

    @abstractmethod
    def features(self, q_tokens: int, kv_tokens: int, tail: bool) -> tuple[float, ...]:
        """Additive features of one request on one group (no validation: hot path)."""

    @abstractmethod
    def group_time(self, totals: Sequence[float]) -> float:
        """Seconds one group needs for features summing to ``totals``.

        Called only for groups holding at least one request; an idle group
        takes no time.
        """

    def group_time_varying(
        self, totals: Sequence[float], i: int, j: int
    ) -> Callable[[float, float], float] | None:
        """``f(x, y)``: :meth:`group_time` of ``totals`` with entries ``i`` and
        ``j`` (``i < j``) replaced by ``x`` and ``y``, the others fixed, giving
        the very same floats; None when the model has no quicker form than
        calling :meth:`group_time` (the default). A decode run prices one
        group step after step with only two totals moving."""
        return None

    def chunk_time_fn(
        self, base: Sequence[float] | None, start: int
    ) -> Callable[[int], float] | None:
        """``f(n)``: :meth:`group_time` of ``base`` plus the features of an
        ``n``-token tail chunk at KV position ``start`` (``base`` None: the chunk
        alone), summed term by term as ``base[k] + features(n, start, True)[k]``,
        giving the very same floats (:meth:`chunk_price` with ``base`` and
        ``start`` bound); None when the model has no :meth:`chunk_price`. A
        prefill turn probes one group for its chunk size."""
        price = self.chunk_price()
        return None if price is None else partial(price, base, start)

    def chunk_price(self) -> Callable[[Sequence[float] | None, int, int], float] | None:
        """``price(base, start, n)``: ``chunk_time_fn(base, start)(n)`` in one call
        (the same floats), or None (the default: no quicker form)."""
        return None

    def predict(self, batch: BatchWork) -> float:
        """Latency in seconds of ``batch``: the slowest group."""
        if len(batch.groups) > self.layout.kvp:
            raise ValueError(
                f"batch has {len(batch.groups)} KVP groups but the layout has kvp={self.layout.kvp}"
            )
        slowest = 0.0
        for items in batch.groups:
            if not items:
                continue
            totals = [0.0] * self.num_features
            for w in items:
                for i, f in enumerate(self.features(w.q_tokens, w.kv_tokens, w.tail)):
                    totals[i] += f
            slowest = max(slowest, self.group_time(totals))
        return slowest
