"""A request and its progress cursors.

Progress is counted one way: ``num_computed_tokens`` against ``num_tokens``.
There are no prefill or decode flags; a request is *prefilling* while its
issued cursor is below ``num_prefill_tokens``. With stream pipelining a chunk
is first *issued* (``num_scheduled_tokens``), then clears stage 0
(``num_stage0_tokens``, after which the next chunk may be issued), then leaves
the pipeline (``num_computed_tokens``).

A decoding request's three cursors move one step per batch together with
every other decode issued in that batch. The scheduler keeps such requests
in a *lane* whose shared counters move the whole group in O(1); a request's
cursor is its own stored base plus its lane's counter, so reading it is
always exact (see :mod:`medha_sched.decode_set`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass(eq=False, slots=True)
class Request:
    """One generation request, as the scheduler sees it.

    Attributes:
        request_id: unique id.
        arrival_time: seconds, on the scheduler's clock.
        num_prompt_tokens: length of the original prompt.
        max_output_tokens: generation stops after this many tokens.
        prompt_token_ids: the prompt's ``num_prompt_tokens`` ids (any sequence,
            kept as a tuple), or ``None`` when only lengths matter (simulation).
        ttft_slo: relative TTFT deadline D in seconds, or ``None`` to derive
            D = max(m * p, min_deadline) at arrival.
        tpot_slo: per-token latency target in seconds, or ``None``.
        priority: strict class; lower numbers are served first.
        prefix_id, prefix_tokens: for requests without token ids
            (simulation): the first ``prefix_tokens`` prompt tokens are those
            of a token stream shared by every request naming ``prefix_id``,
            so the prefix cache can find them (see
            :mod:`medha_sched.prefix_hash`).
        prefix_caching: look the prompt up in the prefix cache (a request
            that needs every prompt position computed, say for prompt
            logprobs, opts out; its KV is still offered to the cache).
        num_cached_tokens: prompt tokens found in the prefix cache at the
            latest admission; the prefill starts after them.
        cache_salt: a non-empty string mixed into the first block's hash
            (vLLM's field): the request shares cached blocks only with
            requests of the same salt; ``None`` shares with unsalted ones.
    """

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_output_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens to prefill: the prompt, or after a preemption by recompute every
    # token so far. A request's chunks sum exactly to this.
    num_prefill_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Set by the scheduler when the request arrives; fixed across preemptions.
    deadline: float = math.inf
    # Predicted prefill work in seconds: of the whole current prompt, and left.
    total_work: float = 0.0
    remaining_work: float = 0.0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    prefix_id: str | None = None
    prefix_tokens: int = 0
    prefix_caching: bool = True
    num_cached_tokens: int = 0
    cache_salt: str | None = None
    # Content hashes of the request's full blocks known so far (prefix caching).
    block_hashes: list = field(default_factory=list, init=False, repr=False)
    # Cursor bases (see the properties below) and the decode lane that moves
    # them, if any: anything with ``issued``, ``cleared`` and ``computed`` counts.
    _scheduled: int = field(default=0, init=False, repr=False)
    _stage0: int = field(default=0, init=False, repr=False)
    _computed: int = field(default=0, init=False, repr=False)
    _lane: Any = field(default=None, init=False, repr=False)

    @classmethod
    def from_tokens(
        cls, request_id: str, arrival_time: float, prompt_token_ids: Sequence[int], **kwargs: object
    ) -> Request:
        """A request whose prompt is given as token ids."""
        ids = tuple(int(t) for t in prompt_token_ids)
        return cls(request_id, arrival_time, len(ids), prompt_token_ids=ids, **kwargs)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not _finite(self.arrival_time):
            raise ValueError(f"arrival_time must be finite, got {self.arrival_time!r}")
        if not isinstance(self.num_prompt_tokens, int) or self.num_prompt_tokens < 1:
            raise ValueError(
                f"request {self.request_id!r}: prompt must have >= 1 token, "
                f"got {self.num_prompt_tokens!r}"
            )
        if not isinstance(self.max_output_tokens, int) or self.max_output_tokens < 1:
            raise ValueError(
                f"request {self.request_id!r}: max_output_tokens must be >= 1, "
                f"got {self.max_output_tokens!r}"
            )
        ids = self.prompt_token_ids
        if ids is not None:
            if not isinstance(ids, tuple):  # a list, say: kept as the tuple slices join with
                ids = self.prompt_token_ids = tuple(ids)
            if len(ids) != self.num_prompt_tokens:
                raise ValueError(
                    f"request {self.request_id!r}: prompt_token_ids holds {len(ids)} ids "
                    f"for num_prompt_tokens={self.num_prompt_tokens}"
                )
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None and (not _finite(value) or value <= 0):
                raise ValueError(f"request {self.request_id!r}: {name} must be > 0, got {value!r}")
        if not isinstance(self.priority, int):
            raise ValueError(f"request {self.request_id!r}: priority must be an int")
        if self.prefix_id is not None and not isinstance(self.prefix_id, str):
            raise ValueError(
                f"request {self.request_id!r}: prefix_id must be a string, got {self.prefix_id!r}"
            )
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(
                f"request {self.request_id!r}: cache_salt must be a non-empty string, got {salt!r}"
            )
        pt = self.prefix_tokens
        if not isinstance(pt, int) or isinstance(pt, bool) or not 0 <= pt <= self.num_prompt_tokens:
            raise ValueError(
                f"request {self.request_id!r}: prefix_tokens must be an integer in "
                f"0..{self.num_prompt_tokens} (the prompt's length), got {pt!r}"
            )
        if self.num_prefill_tokens == 0:
            self.num_prefill_tokens = self.num_prompt_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens issued: the next chunk starts here."""
        lane = self._lane
        return self._scheduled if lane is None else self._scheduled + lane.issued

    @num_scheduled_tokens.setter
    def num_scheduled_tokens(self, value: int) -> None:
        lane = self._lane
        self._scheduled = value if lane is None else value - lane.issued

    @property
    def num_stage0_tokens(self) -> int:
        """Tokens whose batch cleared pipeline stage 0."""
        lane = self._lane
        return self._stage0 if lane is None else self._stage0 + lane.cleared

    @num_stage0_tokens.setter
    def num_stage0_tokens(self, value: int) -> None:
        lane = self._lane
        self._stage0 = value if lane is None else value - lane.cleared

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose batch left the pipeline."""
        lane = self._lane
        return self._computed if lane is None else self._computed + lane.computed

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        lane = self._lane
        self._computed = value if lane is None else value - lane.computed

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: everything whose KV will exist."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Derived, not stored: the issued cursor is still inside the prompt."""
        return self.num_scheduled_tokens < self.num_prefill_tokens

    @property
    def num_remaining_prompt_tokens(self) -> int:
        return self.num_prefill_tokens - self.num_scheduled_tokens

    @property
    def in_flight(self) -> bool:
        """Tokens issued that have not left the pipeline."""
        return self.num_scheduled_tokens > self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Token ids at positions [start, stop), or () when ids are unknown.

        Costs O(stop - start), whatever the prompt's length.
        """
        prompt = self.prompt_token_ids
        if prompt is None:
            return ()
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        tail = tuple(self.output_token_ids[max(0, start - n) : stop - n])
        return prompt[start:] + tail if start < n else tail


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
