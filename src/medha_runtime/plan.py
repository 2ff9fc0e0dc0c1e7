"""The plain data a step sends to every worker, and the block tables workers keep.

A :class:`StepPlan` is derived from one ``medha_sched.ScheduleOutput``. It is
pickled to every rank, so it holds only Python numbers, strings and tuples.
Block tables travel as deltas: each chunk carries the blocks allocated to its
request since it was last scheduled (``ScheduledChunk.new_blocks``), and
``free`` names the requests whose blocks are gone (preempted by recompute,
finished, aborted). Every worker applies a plan in one order: ``free``, then
``finished`` (which also drops sampler state), then each chunk's new blocks,
then runs the batch, then ``release_after``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from medha_runtime.sampling_params import PromptLogprobSpec, SampleSpec


class PlannedChunk(NamedTuple):
    """One request's work in a step (immutable; a named tuple because a step of
    many decodes builds one per decode in the driver's serial window, and a
    tuple is built in a third of a frozen dataclass's time).

    Attributes:
        request_id: the request.
        start: absolute position of the chunk's first token.
        token_ids: the chunk's tokens (``len`` is the chunk size; 1 for a decode).
        kvp_groups: the request's active KVP groups in shard order; shard ``i``
            (positions ``[i*G, (i+1)*G)``) lives on ``kvp_groups[i]``, and the
            last one (the tail) holds the chunk.
        new_blocks: ``(group, block ids)`` to append to the request's tables.
        sample: a :class:`SampleSpec` when the chunk ends at the request's
            newest token (a token is sampled), else None.
        prompt_logprobs: the prompt logprobs wanted from this chunk's rows, or None.
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    kvp_groups: tuple[int, ...]
    new_blocks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    sample: SampleSpec | None = None
    prompt_logprobs: PromptLogprobSpec | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One batch for every rank.

    Attributes:
        step_id: the scheduler's batch id (or a negative id for synthetic
            profiling batches).
        chunks: the batch, in the scheduler's order.
        free: requests whose block tables are dropped before the batch runs.
        finished: requests whose every piece of state (sampler generators
            included) is dropped before the batch runs.
        release_after: requests dropped after the batch (synthetic batches).
    """

    step_id: int
    chunks: tuple[PlannedChunk, ...]
    free: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    release_after: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[type, tuple]:
        # pickled by the constructor (every step goes to every worker): a frozen slots
        # dataclass would otherwise pickle a state dict built field by field
        args = (self.step_id, self.chunks, self.free, self.finished, self.release_after)
        return StepPlan, args

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def samples(self) -> tuple[SampleSpec, ...]:
        """The rows sampled, in chunk order (the order of the logits' rows)."""
        return tuple(c.sample for c in self.chunks if c.sample is not None)


class BlockTables:
    """Per request, per KVP group, the block ids of its shard on that group, in order.

    Each table is an ``array('i')`` (int32, like the kernels' block tables): a
    step copies a long table into its int32 tensors with one ``memcpy`` instead
    of converting thousands of Python ints (a 32K-token decode's table on one
    group is 1,024 blocks).
    """

    def __init__(self) -> None:
        self._tables: dict[str, dict[int, array]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._tables.pop(rid, None)

    def extend(self, request_id: str, new_blocks: Iterable[tuple[int, Iterable[int]]]) -> None:
        tables = self._tables.setdefault(request_id, {})
        for group, blocks in new_blocks:
            table = tables.get(group)
            if table is None:
                table = tables[group] = array("i")
            table.extend(blocks)

    def blocks(self, request_id: str, group: int) -> array:
        """The request's blocks on ``group``, ``array('i')`` (empty if it holds none there).

        The table itself, not a copy: read it (or slice it) within the step.
        """
        return self._tables.get(request_id, {}).get(group, _EMPTY)


_EMPTY = array("i")
