"""Choosing a chunk: the largest on the token grid whose batch fits the budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar


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
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid!r}")
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


_GUESSES = 4
"""Probes :func:`largest_chunk_within` places by interpolation before it bisects."""

_B = TypeVar("_B")  # what largest_chunk_priced passes through to its price


def largest_chunk_within(
    limit: int,
    grid: int,
    time_of: Callable[[int], float],
    target: float,
    *,
    base: float = 0.0,
    hint: int = 0,
) -> int:
    """``largest_fitting_chunk(limit, grid, lambda n: time_of(n) <= target)``,
    with the probes placed where the times point.

    ``time_of`` (seconds of the batch with an ``n``-token chunk) must be
    non-decreasing in ``n``; then the answer is that of
    :func:`largest_fitting_chunk`, whatever the probes. The first probe is
    ``hint`` (else ``limit``); each next one is where the line through the
    two latest probes (at first, the point ``(0, base)`` and the first probe)
    reaches ``target``, rounded down to the grid, kept strictly between the
    largest candidate seen to fit and the smallest seen not to. With a time
    nearly linear in ``n`` that is two or three probes. After ``_GUESSES``
    such probes, or when the line does not rise, it bisects: at most
    ``log2(limit / grid) + _GUESSES + 1`` calls in all.
    """
    # one search for both: largest_chunk_priced with a price that ignores its base and start
    chunk, _ = largest_chunk_priced(
        limit, grid, lambda _base, _start, n: time_of(n), None, 0, target, base, hint
    )
    return chunk


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


def chunk_search(
    price: Callable[[_B, int, int], float],
) -> Callable[[int, int, _B, int, float, float, int], tuple[int, float]]:
    """``search(limit, grid, base, start, target, base_time, hint)``: what
    :func:`largest_chunk_priced` answers with ``price``. The price's own
    ``search`` attribute where it has one (a cost model's quicker search for
    its own price, the same answer: the roofline's), else that function."""
    search = getattr(price, "search", None)
    if search is not None:
        return search

    def search(
        limit: int, grid: int, base: _B, start: int, target: float, base_time: float, hint: int
    ) -> tuple[int, float]:
        return largest_chunk_priced(limit, grid, price, base, start, target, base_time, hint)

    return search


def largest_chunk_priced(
    limit: int,
    grid: int,
    price: Callable[[_B, int, int], float],
    base: _B,
    start: int,
    target: float,
    base_time: float,
    hint: int,
) -> tuple[int, float]:
    """:func:`largest_chunk_within` with ``time_of(n) = price(base, start, n)``
    (a cost model's ``chunk_price``), and the chosen chunk's time: ``(chunk,
    seconds)``, ``(0, 0.0)`` when none fits. The same probes in the same order
    (so the same answer), without a closure per search. ``base`` is passed
    through to ``price`` as it is (summed features, None, or a
    :meth:`BatchCost.tail_price <medha_sched.batch_cost.BatchCost.tail_price>`
    group)."""
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid!r}")
    if limit <= 0:
        return 0, 0.0
    count = -(-limit // grid)
    top = count - 1
    lo, hi = -1, count
    fit = 0.0  # the time of candidate lo
    i = min(max(hint // grid - 1, 0), top) if hint > 0 else top
    n0, t0 = 0, base_time
    guesses = 0
    while True:
        n = (i + 1) * grid
        if n > limit:
            n = limit
        t = price(base, start, n)
        if t <= target:
            lo = i
            fit = t
        else:
            hi = i
        if hi - lo <= 1:
            if lo < 0:
                return 0, 0.0
            return min((lo + 1) * grid, limit), fit
        if guesses < _GUESSES and (t - t0) * (n - n0) > 0:  # the line rises
            guesses += 1
            est = n + (target - t) * (n - n0) / (t - t0)  # where the line reaches target
            if est >= limit:
                i = top
            elif est >= grid:
                i = int(est // grid) - 1  # the largest candidate at most est
            else:  # below the grid, or not a number (infinite times): the bracket decides
                i = 0
        else:
            i = (lo + hi) // 2
        if i <= lo:
            i = lo + 1
        elif i >= hi:
            i = hi - 1
        n0, t0 = n, t
