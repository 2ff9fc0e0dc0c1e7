"""Choosing a chunk: the largest on the token grid whose batch fits the budget."""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting_chunk(
    limit: int, grid: int, fits: Callable[[int], bool], *, hint: int = 0
) -> int:
    """The largest candidate chunk for which ``fits`` is true, or 0.

    Candidates are ``grid, 2*grid, ...`` below ``limit``, and ``limit`` itself
    (a request's final piece, or the room left in its KVP shard). ``fits``
    must be monotone: if a chunk fits, every smaller one does. The search only
    ever returns a chunk it has seen fit, so it never overshoots the budget.
    It tries ``limit`` first (a short prompt usually fits whole: one call),
    then bisects: at most ``log2(limit / grid) + 2`` calls.

    ``hint`` (say, the request's previous chunk) only changes the order of the
    calls, never the answer: the search starts there and gallops outwards,
    so an exact hint costs two calls.
    """
    if limit <= 0:
        return 0
    count = -(-limit // grid)
    if hint > 0:
        start = min(max(hint // grid - 1, 0), count - 1)
        best = _gallop(count - 1, start, grid, limit, fits)
        return min((best + 1) * grid, limit) if best >= 0 else 0
    if fits(limit):
        return limit
    if not fits(grid if grid < limit else limit):
        return 0
    lo, hi = 0, count - 2  # candidate lo fits; candidate count - 1 (== limit) does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits((mid + 1) * grid):  # mid < count - 1: below limit
            lo = mid
        else:
            hi = mid - 1
    return min((lo + 1) * grid, limit)


def _gallop(top: int, start: int, grid: int, limit: int, fits: Callable[[int], bool]) -> int:
    """Largest index ``i`` in ``[0, top]`` whose candidate ``min((i + 1) * grid,
    limit)`` fits, or -1 if none does.

    Doubling steps from ``start`` bracket the answer, then bisection finds it.
    """
    h = min(start, top)
    step = 1
    if fits(min((h + 1) * grid, limit)):
        lo, hi = h, top + 1  # lo fits; hi does not (or is past the end)
        while lo + step < hi:
            if not fits(min((lo + step + 1) * grid, limit)):
                hi = lo + step
                break
            lo += step
            step *= 2
    else:
        if h == 0:
            return -1
        hi = h
        while True:
            probe = max(hi - step, 0)
            if fits(min((probe + 1) * grid, limit)):
                lo = probe
                break
            hi = probe
            if probe == 0:
                return -1
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(min((mid + 1) * grid, limit)):
            lo = mid
        else:
            hi = mid
    return lo
