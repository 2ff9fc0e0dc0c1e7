"""Plain data exchanged between the scheduler and an executor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple


class ScheduledChunk(NamedTuple):
    """Work for one request in one batch (an immutable named tuple).

    Attributes:
        request_id: the request.
        start: position of the chunk's first token.
        num_tokens: tokens in the chunk (1 for a decode).
        kvp_groups: the request's active KVP groups in shard order; the last
            one appends the chunk's KV and runs causal attention, the others
            attend non-causally to their full shard.
        new_blocks: ``(group, block ids)`` allocated to the request since it
            was last scheduled (all of them on its first chunk).
        token_ids: the chunk's token ids, or ``()`` when ids are unknown.
        samples: the chunk reaches the request's newest token, so the
            executor samples the next token.
    """

    request_id: str
    start: int
    num_tokens: int
    kvp_groups: tuple[int, ...]
    new_blocks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    token_ids: tuple[int, ...] = ()
    samples: bool = False


@dataclass(frozen=True, slots=True)
class ScheduleOutput:
    """One batch, as ``Scheduler.schedule`` forms it.

    Attributes:
        batch_id: increasing id, used to report stage and batch ends.
        time: scheduler clock when the batch was formed.
        chunks: decodes first, then prefill chunks in policy order.
        preempted: requests preempted by recompute while forming it.
        predicted_time: cost-model latency of the batch, seconds.
        target_time: the budget T the batch was packed against, seconds.
    """

    batch_id: int
    time: float
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()
    predicted_time: float = 0.0
    target_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What the executor reports when a batch leaves the pipeline.

    Attributes:
        sampled_token_ids: one new token per chunk that ``samples``.
        stopped: requests the executor ended (EOS, stop string).
    """

    sampled_token_ids: Mapping[str, int] = field(default_factory=dict)
    stopped: frozenset[str] = frozenset()
