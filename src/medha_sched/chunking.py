"""Choosing a chunk: the largest on the token grid whose batch fits the budget."""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting_chunk(limit: int, grid: int, fits: Callable[[int], bool]) -> int:
    """The largest candidate chunk for which ``fits`` is true, or 0.

    Candidates are ``grid, 2*grid, ...`` below ``limit``, and ``limit`` itself
    (a request's final piece, or the room left in its KVP shard). ``fits``
    must be monotone: if a chunk fits, every smaller one does. The search only
    ever returns a chunk it has seen fit, so it never overshoots the budget.
    It tries ``limit`` first (a short prompt usually fits whole: one call),
    then bisects: at most ``log2(limit / grid) + 2`` calls.
    """
    if limit <= 0:
        return 0
    if fits(limit):
        return limit
    count = -(-limit // grid)

    def candidate(i: int) -> int:
        return min((i + 1) * grid, limit)

    if not fits(candidate(0)):
        return 0
    lo, hi = 0, count - 2  # candidate(lo) fits; candidate(count - 1) == limit does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(candidate(mid)):
            lo = mid
        else:
            hi = mid - 1
    return candidate(lo)
