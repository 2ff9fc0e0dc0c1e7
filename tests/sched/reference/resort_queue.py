"""A vidur-style prefill queue: every key recomputed and the queue fully re-sorted at each step.

The same order as ``medha_sched.queue.PrefillQueue`` (priority class, then
the policy's key at ``now``, then arrival, then order of insertion), found
the way vidur's Mnemosyne schedulers find it: ``sorted`` over all waiting
requests at every decision, O(n log n) however few are looked at.
"""

from __future__ import annotations

from collections.abc import Iterator

from medha_sched.policies.base import Policy
from medha_sched.request import Request


class ResortQueue:
    """Drop-in for ``PrefillQueue`` that re-sorts at every ``iter_sorted``."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._entries: dict[str, tuple[Request, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def push(self, request: Request) -> None:
        rid = request.request_id
        if rid not in self._entries:
            self._seq += 1
            self._entries[rid] = (request, self._seq)

    def remove(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def iter_sorted(self, now: float) -> Iterator[Request]:
        line = self._policy.line

        def key(entry: tuple[Request, int]) -> tuple[int, float, float, int]:
            r, seq = entry
            intercept, slope = line(r)
            return (r.priority, intercept + slope * now, r.arrival_time, seq)

        return (r for r, _ in sorted(self._entries.values(), key=key))
