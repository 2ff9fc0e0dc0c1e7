"""Plain data exchanged between the scheduler and an executor.

A batch's decodes travel in a compact form (:class:`DecodeBatch`): most of
them are the decodes of an earlier batch one token further, so the batch
names those earlier batches and lists only what changed. ``chunks`` still
spells every decode out, on demand, for executors that want them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
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


#: The token id of a decode issued ahead (``SchedulerConfig.async_decodes``):
#: "the token the previous batch samples for this request". An executor
#: running batches in order substitutes the request's last sampled token.
PENDING_TOKEN = -1

#: ``(group, request ids, block ids)``: ``block ids[i]`` went to ``request ids[i]``
BlockGrant = tuple[int, tuple[str, ...], tuple[int, ...]]


def _no_chunks() -> tuple[ScheduledChunk, ...]:
    return ()


@dataclass(frozen=True, slots=True, eq=False)
class DecodeBatch:
    """A batch's decodes, as a difference from the batches they continue.

    Every decode of a ``parents`` batch that is not in ``left`` is in this
    batch too, one position further, on the same KVP groups, with no new
    blocks unless ``new_blocks`` names it. ``new`` spells out the decodes
    that are in no parent, or whose KVP groups changed (a new shard): apply
    ``left`` first, then ``new``. A batch with no parents lists every decode
    in ``new``. :class:`DecodeTracker` turns the difference back into chunks.

    Attributes:
        count: decodes in the batch.
        parents: ids of the earlier batches whose decodes this batch continues.
        left: request ids of parents' decodes not in this batch (finished,
            preempted, aborted or left out).
        new: full chunks of the decodes the parents do not give.
        new_blocks: blocks allocated to continuing decodes that crossed a
            block boundary, per group (see ``BlockGrant``).
    """

    count: int = 0
    parents: tuple[int, ...] = ()
    left: tuple[str, ...] = ()
    new: tuple[ScheduledChunk, ...] = ()
    new_blocks: tuple[BlockGrant, ...] = ()
    # Spells out every decode chunk, in the scheduler's order (see ``chunks``).
    _spell: Callable[[], tuple[ScheduledChunk, ...]] = field(
        default=_no_chunks, repr=False, compare=False
    )
    _chunks: tuple[ScheduledChunk, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def from_chunks(cls, chunks: Iterable[ScheduledChunk]) -> DecodeBatch:
        """Decodes given in full: no parents, every chunk new."""
        chunks = tuple(chunks)
        return cls(len(chunks), new=chunks, _spell=lambda: chunks)

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        """Every decode chunk, in running order (built once, on first use)."""
        chunks = self._chunks
        if chunks is None:
            chunks = self._spell()
            object.__setattr__(self, "_chunks", chunks)
        return chunks

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(c.request_id for c in self.chunks)


EMPTY_DECODES = DecodeBatch()


@dataclass(frozen=True, slots=True, eq=False)
class ScheduleOutput:
    """One batch, as ``Scheduler.schedule`` forms it.

    Attributes:
        batch_id: increasing id, used to report stage and batch ends.
        time: scheduler clock when the batch was formed.
        prefill_chunks: prefill chunks in policy order.
        preempted: requests preempted by recompute while forming it.
        predicted_time: cost-model latency of the batch, seconds.
        target_time: the budget T the batch was packed against, seconds.
        decodes: the decodes, compactly (:class:`DecodeBatch`).

    ``chunks`` gives every chunk, decodes first; two outputs are equal when
    their ids, times, chunks, preemptions and predictions are.
    """

    batch_id: int
    time: float
    prefill_chunks: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[str, ...] = ()
    predicted_time: float = 0.0
    target_time: float = 0.0
    decodes: DecodeBatch = EMPTY_DECODES

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        """Decodes first (running order), then prefill chunks (policy order)."""
        if not self.decodes.count:
            return self.prefill_chunks
        return self.decodes.chunks + self.prefill_chunks

    @property
    def num_decodes(self) -> int:
        return self.decodes.count

    @property
    def num_tokens(self) -> int:
        return self.decodes.count + sum(c.num_tokens for c in self.prefill_chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes.count and not self.prefill_chunks

    def _key(self) -> tuple[object, ...]:
        return (
            self.batch_id,
            self.time,
            self.chunks,
            self.preempted,
            self.predicted_time,
            self.target_time,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScheduleOutput):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]


class DecodeTracker:
    """Executor-side state that turns each batch's :class:`DecodeBatch` back into chunks.

    Feed it every non-empty batch, in issue order. It keeps, per batch not yet
    continued, the decodes as ``request id -> (start, kvp groups)``.
    """

    def __init__(self) -> None:
        self._sets: dict[int, dict[str, tuple[int, tuple[int, ...]]]] = {}

    def decodes(self, out: ScheduleOutput) -> dict[str, tuple[int, tuple[int, ...], tuple]]:
        """``request id -> (start, kvp groups, new blocks)`` of ``out``'s decodes."""
        d = out.decodes
        current: dict[str, tuple[int, tuple[int, ...]]] = {}
        for parent in d.parents:
            for rid, (start, groups) in self._sets.pop(parent).items():
                current[rid] = (start + 1, groups)
        for rid in d.left:
            del current[rid]
        for c in d.new:
            current[c.request_id] = (c.start, c.kvp_groups)
        if len(current) != d.count:
            raise ValueError(f"batch {out.batch_id}: {len(current)} decodes, expected {d.count}")
        self._sets[out.batch_id] = current
        blocks: dict[str, list[tuple[int, tuple[int, ...]]]] = {
            c.request_id: list(c.new_blocks) for c in d.new
        }
        for group, rids, ids in d.new_blocks:
            for rid, block in zip(rids, ids, strict=True):
                blocks.setdefault(rid, []).append((group, (block,)))
        return {
            rid: (start, groups, tuple(blocks.get(rid, ())))
            for rid, (start, groups) in current.items()
        }

    def forget(self, batch_ids: Iterable[int]) -> None:
        """Drop batches that will never be continued (say, after a restart)."""
        for b in batch_ids:
            self._sets.pop(b, None)


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What the executor reports when a batch leaves the pipeline.

    Attributes:
        sampled_token_ids: one new token per chunk that ``samples``, an integer.
            :meth:`~medha_sched.Scheduler.on_batch_end` refuses a result that lacks
            one or holds a non-integer (``SchedulerError``), changing nothing: the
            batch stays in flight for a corrected result.
        stopped: requests the executor ended (EOS, stop string).
    """

    sampled_token_ids: Mapping[str, int] = field(default_factory=dict)
    stopped: frozenset[str] = frozenset()
