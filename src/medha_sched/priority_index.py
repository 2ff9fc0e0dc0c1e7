"""Kinetic tournament tree over priority keys that are lines in time.

Every policy gives item ``i`` the key ``key_i(t) = intercept_i + slope_i * t``
(FCFS ``(arrival, 0)``, EDF ``(deadline, 0)``, SRPT ``(remaining, 0)``, LARS
relative slack ``((a + D - w_rem) / W, -1 / W)``); smaller is served first and
a static ``tiebreak`` tuple breaks ties. Keys change with time, so they are
never cached as heap values: the leaves store the line parameters.

Algorithm (Basch, Guibas & Hershberger, "Data structures for mobile data",
1997). Leaves sit in a power-of-two array (doubled when full; freed slots are
reused). Each internal node holds the slot of its subtree's winner at the
structure's clock and a *certificate*: the time at which the loser of its match
overtakes the winner (the crossing time when the loser's slope is smaller,
else never). ``advance`` pops failed certificates from one global heap of
``(time, node, version)`` entries in time order (stale entries are skipped by
version) and replays the failed match and the matches above it while the
winner changes. ``iter_sorted`` never touches the tree: a best-first search
keeps a heap of disjoint subtrees keyed by their winners; popping one yields
its winner and pushes the siblings on the path down to that winner's leaf.

Layout. Which leaf holds an item changes no winner (but between keys within
rounding error, below), yet it sets how often certificates fail: a node fails
each time the lower envelope of its subtree's lines changes hands. Lines that
arrive together with nearly equal keys and different slopes (a queue filled at
once under LARS) cross within seconds, and with leaves in order of arrival
nearly every low node holds such a pair. So every capacity doubling lays the
items out again in order of slope, half filling pages of ``_PAGE`` leaves, and
a new item takes a free leaf in the page laid out for its slope (else a page
near it, else any): low nodes then hold nearly parallel lines, which cross
late. 4,000 such lines failed 665 certificates in their first 1.5 s in order
of arrival and 93 laid out by slope (``tests/sched/test_priority_index.py``).
Inside a page, though, the items added since the layout sit in order of
arrival; so once a burst of adds (no clock move between them: a queue filled
at once) reaches a quarter of the items the layout placed (256 or more), the
items are laid out again at the same capacity (the adds pay for it, as for a
doubling).

Robustness. A match between lines ``s`` and ``t`` with different slopes is
decided by their crossing time ``tau = (b_t - b_s) / (m_s - m_t)``, computed by
the very float expression that becomes the certificate, so a winner flips
exactly when its certificate fails: float jitter near a crossing can neither
leave the tree stale nor loop. At ``tau`` itself the smaller slope wins (it is
smaller from then on); equal slopes compare intercepts, then tiebreaks. The
order equals sorting by ``(b + m * t, tiebreak)`` except between keys that
differ by rounding error (a few ulps of ``|b| + |m * t|``): there the order
depends on the layout, hot seats included (three or more lines meeting at the
query time, matched in another order, may name another winner). Items with
the same line and the same tiebreak come in the layout's order too: give
every item its own tiebreak (the scheduler's hold its arrival and sequence).

Costs for ``n`` items: add/update/remove O(log n) matches (add amortised: a
doubling sorts the items); advance O(log n)
per failed certificate (for fixed lines O(n log n) failures over all time);
the first ``k`` items of ``iter_sorted`` O(k log n log k); ``peek`` O(1) after
advancing.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Any, Generic, TypeVar

__all__ = ["AHEAD_RTOL", "MAX_MAGNITUDE", "IndexStats", "KineticIndex"]

K = TypeVar("K", bound=Hashable)

MAX_MAGNITUDE = 1e300
"""Largest accepted ``|intercept|`` / ``|slope|``: their differences stay finite."""

AHEAD_RTOL = 1e-10
"""The margin of :meth:`KineticIndex.count_ahead`, relative to the largest key magnitude."""

_INF = math.inf
_CHECK_RTOL = 1e-9
_PAGE = 16
"""Leaves per page: a run of slots that new items of nearby slopes fill (see ``_grow``)."""
_NEAR_PAGES = 4
"""Pages either side of a full page searched for a free slot before any page will do."""
_HOT_SEATS = 3
"""Items last renewed in place kept out of the tree (see :meth:`KineticIndex.renew`)."""
_RELAY_MIN = 256
"""Fewest items a layout must have placed for a burst of adds to lay them out
again at the same capacity (see :meth:`KineticIndex.add`): a small index is
left alone."""
_RELAY_SHARE = 4
"""Adds in one burst (no clock move between them) that lay the items out again,
as a share of the items the latest layout placed: one in ``_RELAY_SHARE``."""


@dataclass(slots=True)
class IndexStats:
    """Work counters of a :class:`KineticIndex` (they only grow; see ``reset``)."""

    comparisons: int = 0
    """Matches played at internal nodes (insert, update, remove, certificate failure)."""
    key_evals: int = 0
    """Subtree winners whose key ``iter_sorted`` evaluated."""
    events: int = 0
    """Certificate failures processed by ``advance``."""
    rebuilds: int = 0
    """Capacity doublings (each replays every match)."""
    relayouts: int = 0
    """Layouts at the same capacity, after many adds (each replays every match)."""

    @property
    def evaluations(self) -> int:
        """Tree-node evaluations of any kind: ``comparisons + key_evals``."""
        return self.comparisons + self.key_evals

    def reset(self) -> None:
        """Set every counter to zero."""
        self.comparisons = self.key_evals = self.events = self.rebuilds = 0


def _coordinate(item: object, name: str, value: object) -> float:
    """``value`` as a float, or ValueError naming the item and the value."""
    if type(value) is float:
        x = value
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        x = float(value)
    else:
        raise ValueError(f"{name} of item {item!r} must be a real number, got {value!r}")
    if not -MAX_MAGNITUDE <= x <= MAX_MAGNITUDE:
        raise ValueError(
            f"{name} of item {item!r} must be finite with magnitude <= {MAX_MAGNITUDE:g}, "
            f"got {value!r}"
        )
    return x


def _time(value: object) -> float:
    """A finite time as a float, or ValueError naming it."""
    if type(value) is float:
        t = value
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        t = float(value)
    else:
        raise ValueError(f"time must be a real number, got {value!r}")
    if not math.isfinite(t):
        raise ValueError(f"time must be finite, got {value!r}")
    return t


class KineticIndex(Generic[K]):
    """Items ordered by ``intercept + slope * t`` at a clock that only moves forward.

    Mutating the index (``add``, ``update``, ``remove``, or ``advance`` to a
    later time) while an ``iter_sorted`` generator is live makes that
    generator's next step raise RuntimeError; abandoned generators are harmless,
    so collect candidates first and mutate afterwards.
    """

    def __init__(self, start: float = 0.0) -> None:
        """An empty index whose clock starts at ``start``."""
        self._clock = _time(start)
        self._slot: dict[K, int] = {}
        self._items: list[Any] = [None]
        self._b: list[float] = [0.0]
        self._m: list[float] = [0.0]
        self._tb: list[tuple[Any, ...]] = [()]
        self._page = 1  # slots per page: min(_PAGE, capacity)
        self._page_free: list[list[int]] = [[0]]  # page -> its free slots (lowest last)
        self._page_lo: list[float] = []  # page -> smallest slope placed there at the layout
        self._num_free = 1
        self._open: list[int] = [0]  # every page with a free slot, and some full ones
        # (with one page, it stays listed: a small index never looks at the list)
        self._cap = 1
        self._win: list[int] = [-1, -1]  # node -> winning slot; leaves at cap + slot
        self._ver: list[int] = [0]
        self._cert: list[float] = [_INF]
        self._events: list[tuple[float, int, int]] = []
        self._epoch = 0
        # at least the largest |intercept| and |slope| of the live lines (the bound
        # of count_ahead): raised as lines come, set to the live maxima again at
        # every rebuild and event compaction (_refresh_bounds) and when emptied
        self._hi_b = 0.0
        self._hi_m = 0.0
        # the hot seats: slots of items last renewed in place (most recent last),
        # their leaves empty; every query matches them against the root's winner
        self._hot: list[int] = []
        self._seats = _HOT_SEATS  # 0: every item in the tree (the plain path)
        # a burst of adds lays the items out again at this capacity (see add):
        # how many adds (0: never, a small index: nothing is counted), and the
        # adds of the burst at the clock _burst still to come
        self._relay_every = 0
        self._relay_in = 0
        self._burst = math.nan  # (no burst yet)
        self.stats = IndexStats()

    # ----------------------------------------------------------------- queries

    @property
    def clock(self) -> float:
        """The time the tree is valid at (the latest ``advance``)."""
        return self._clock

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, item: object) -> bool:
        return item in self._slot

    def key_of(self, item: K, now: float) -> float:
        """``intercept + slope * now`` of ``item`` (pure: does not advance)."""
        slot = self._lookup(item)
        return self._b[slot] + self._m[slot] * now

    def peek(self, now: float) -> K | None:
        """Advance to ``now`` and return the highest-priority item, or None if empty."""
        clock = self._clock
        if type(now) is float and clock < now < _INF:
            # advance(now) past its checks, written out (every prefill turn peeks at
            # a later time; twin-tested in tests/sched/test_turn_queue_calls.py)
            events = self._events
            if events and events[0][0] <= now:
                self._fail_until(now)
            self._clock = now
            self._epoch += 1
            if len(self._events) > 2 * self._cap + 32:
                self._compact_events()
        elif type(now) is not float or now != clock:
            self.advance(now)  # (its errors, and times that are no float)
        slot = self._win[1]
        if self._hot:
            slot = self._with_hot(slot)
        return None if slot < 0 else self._items[slot]

    def iter_sorted(self, now: float) -> Iterator[K]:
        """Advance to ``now``; lazily yield items by increasing ``(key(now), tiebreak)``.

        The first ``k`` items cost O(k log n log k); the tree is not modified.
        """
        if now != self._clock:  # (advance's answer at the clock, without the call)
            self.advance(now)
        return self._best_first()

    def places(self, items: Iterable[K], now: float) -> dict[int, K] | None:
        """Advance to ``now``; where :meth:`iter_sorted` yields each of ``items``
        (distinct, in the index): ``{place: item}``, places counted from 0, when
        the keys alone tell, else None. They tell when each of ``items`` has a
        key more than :meth:`count_ahead`'s margin away from every other key:
        then every item with a lower key comes before it and every other one
        after it (``count_ahead``'s proof, both ways), so its place is the
        number of lower keys. One key per item and a sort: O(n log n).
        """
        if now != self._clock:  # (advance's answer at the clock, without the call)
            self.advance(now)
        now = self._clock
        b, m, slot_of = self._b, self._m, self._slot
        margin = AHEAD_RTOL * (self._hi_b + self._hi_m * abs(now))
        if not margin < _INF:
            return None  # (NaN too)
        keys = sorted([b[s] + m[s] * now for s in slot_of.values()])
        found = {}
        for item in items:
            s = slot_of[item]
            key = b[s] + m[s] * now
            if not -_INF < key < _INF:
                return None  # keys past the float range: nothing is told
            place = bisect_left(keys, key - margin)
            if bisect_right(keys, key + margin, place) != place + 1:
                return None  # another key within the margin: the layout decides
            found[place] = item
        return found

    def count_ahead(self, ahead: Iterable[K], behind: Iterable[K], now: float) -> int:
        """Advance to ``now``; how many distinct items of ``ahead`` (those not in
        the index left out) ``iter_sorted(now)`` yields before every item of
        ``behind``, as far as keys alone tell: those whose key at ``now`` is
        below every ``behind`` key by more than ``AHEAD_RTOL`` times a bound
        ``M`` on ``|intercept| + |slope * now|`` of the lines in the index (the
        largest ``|intercept|`` plus the largest ``|slope|`` times ``|now|``, as
        of the latest rebuild or event compaction, raised by every line stored
        since: a line that left stops counting there). All of ``ahead`` when
        ``behind`` is empty. A lower bound on the place of ``behind``'s first
        item in the iteration, found without it.

        Why the margin is enough: when ``iter_sorted`` yields ``y``, the winner
        of the subtree it pops, every item ``z`` not yet yielded lies in that
        subtree or in one waiting in its heap, whose winner has a key at least
        ``y``'s (the heap pops the smallest). A match at the clock gives its
        winner a key at most ``16 u M`` above the loser's (``u`` the unit
        roundoff, ``M`` that bound: every match in the tree was played between
        lines still in it, as a line that leaves or changes has the matches it
        won replayed; the crossing time is off by 3
        ulps and each key by 2), so a winner's key is at most ``16 u M`` per
        level above its subtree's least key, ``z``'s at most. So ``key(y) <=
        key(z) + 16 u M depth``, and a ``z`` with ``key(z) + AHEAD_RTOL M <
        key(y)`` comes first (``AHEAD_RTOL`` is over 800 times ``16 u`` times
        64 levels).
        """
        if now != self._clock:  # (advance's answer at the clock, without the call)
            self.advance(now)
        now = self._clock
        slot_of, b, m = self._slot, self._b, self._m
        keys = [b[s] + m[s] * now for s in map(slot_of.__getitem__, behind)]
        if not keys:
            return len({item for item in ahead if item in slot_of})
        low = min(keys)  # (finite lines and clock: a key is a number, maybe infinite)
        low -= AHEAD_RTOL * (self._hi_b + self._hi_m * abs(now))
        if not -_INF < low < _INF:
            return 0  # keys past the float range: nothing is told
        return len(
            {
                item
                for item in ahead
                if (s := slot_of.get(item)) is not None and b[s] + m[s] * now < low
            }
        )

    # --------------------------------------------------------------- mutation

    def add(self, item: K, *, intercept: float, slope: float, tiebreak: tuple[Any, ...]) -> None:
        """Insert ``item`` with key line ``intercept + slope * t``.

        Before the slot is taken, a full index doubles (:meth:`_grow`). After
        the insertion, an add that makes a burst of adds (at one clock, no
        advance between them) reach one in ``_RELAY_SHARE`` of the
        ``_RELAY_MIN`` or more items the latest layout placed lays the items
        out again at this capacity (:meth:`_lay_out`): in a queue filled at
        once, the items added after a layout (in order of arrival inside each
        page) made the certificates fail about twice as often. Adds spread
        over time (a few between queries) never do."""
        if item in self._slot:
            raise ValueError(f"item {item!r} is already in the index")
        # _coordinate's answer for a float in range, without the call (the hot path)
        b = (
            intercept
            if type(intercept) is float and -MAX_MAGNITUDE <= intercept <= MAX_MAGNITUDE
            else _coordinate(item, "intercept", intercept)
        )
        m = (
            slope
            if type(slope) is float and -MAX_MAGNITUDE <= slope <= MAX_MAGNITUDE
            else _coordinate(item, "slope", slope)
        )
        if not isinstance(tiebreak, tuple):
            raise TypeError(f"tiebreak of item {item!r} must be a tuple, got {tiebreak!r}")
        if not self._num_free:
            self._grow()
        if not -self._hi_b <= b <= self._hi_b:
            self._hi_b = abs(b)
        if not -self._hi_m <= m <= self._hi_m:
            self._hi_m = abs(m)
        slot = self._take(m)
        self._slot[item] = slot
        self._items[slot], self._b[slot], self._m[slot], self._tb[slot] = item, b, m, tiebreak
        self._win[self._cap + slot] = slot
        self._repair(slot)
        every = self._relay_every
        if every:  # this add counted in its burst (one starts where the clock moved)
            relay = (every if self._clock != self._burst else self._relay_in) - 1
            self._burst = self._clock
            if relay > 0:
                self._relay_in = relay
            else:
                self._lay_out(self._cap)
                self.stats.relayouts += 1

    def update(self, item: K, *, intercept: float, slope: float) -> None:
        """Replace the key line of ``item`` (its tiebreak is kept)."""
        slot = self._lookup(item)
        # _coordinate's answer for a float in range, without the call (the hot path)
        b = (
            intercept
            if type(intercept) is float and -MAX_MAGNITUDE <= intercept <= MAX_MAGNITUDE
            else _coordinate(item, "intercept", intercept)
        )
        m = (
            slope
            if type(slope) is float and -MAX_MAGNITUDE <= slope <= MAX_MAGNITUDE
            else _coordinate(item, "slope", slope)
        )
        if b == self._b[slot] and m == self._m[slot]:
            return
        if not -self._hi_b <= b <= self._hi_b:
            self._hi_b = abs(b)
        if not -self._hi_m <= m <= self._hi_m:
            self._hi_m = abs(m)
        self._b[slot], self._m[slot] = b, m
        if slot in self._hot:  # out of the tree: no match to replay
            self._epoch += 1
            return
        self._repair(slot)

    def renew(
        self,
        item: K,
        *,
        intercept: float,
        slope: float,
        tiebreak: tuple[Any, ...],
        move: bool = True,
    ) -> bool:
        """:meth:`remove` then :meth:`add` of ``item`` in one step: the slots,
        free lists, open pages and keys end as after the pair. Most often the
        pair leaves the item in its slot (one page, or its slot's page has
        another free slot and is the page laid out for the new slope); else
        it moves to the slot the add would take, the bookkeeping of both done
        as they do it. ``move`` False refuses that case: returns False,
        changing nothing (the caller has removals of its own to do first).

        The renewed item takes a hot seat: its leaf is emptied (the matches
        above it replayed without it, once) and every query matches it
        against the tree's winner, so renewing it again costs O(1) instead
        of the matches up to the root (a prefill taking turn after turn is
        renewed at each, often two or three taking turns in alternation). The seat
        least recently renewed goes back to its leaf when one more item is
        renewed, and every seat at a capacity doubling. Slots, free lists and
        keys are as after the pair; the tree with the seated items put back
        in their leaves is as after it (every node's match at the clock), and
        every answer the same but between keys within rounding error of each
        other, as with any other layout (see the module docstring). Where the
        pair's add lays the items out again (:meth:`add`), that is done: the
        pair itself (refused with ``move`` False).
        """
        slot = self._slot.get(item)  # _lookup's, without the call (every prefill turn)
        if slot is None:
            raise ValueError(f"item {item!r} is not in the index")
        # _coordinate's answer for a float in range, without the call (the hot path)
        b = (
            intercept
            if type(intercept) is float and -MAX_MAGNITUDE <= intercept <= MAX_MAGNITUDE
            else _coordinate(item, "intercept", intercept)
        )
        m = (
            slope
            if type(slope) is float and -MAX_MAGNITUDE <= slope <= MAX_MAGNITUDE
            else _coordinate(item, "slope", slope)
        )
        if not isinstance(tiebreak, tuple):
            raise TypeError(f"tiebreak of item {item!r} must be a tuple, got {tiebreak!r}")
        every = self._relay_every
        relay = 0
        if every:  # the pair's add is counted (see add)
            relay = every if self._clock != self._burst else self._relay_in
            if relay <= 1:  # and it lays the items out again: the pair itself
                if not move:
                    return False
                self.remove(item)
                self.add(item, intercept=b, slope=m, tiebreak=tiebreak)
                return True
        pages = self._page_free
        if len(pages) > 1:
            page = slot // self._page
            p = bisect_right(self._page_lo, m) - 1
            # remove would list a full page as open again, or add take a slot elsewhere
            if not pages[page] or (p if p > 0 else 0) != page:
                if not move:
                    return False
                if every:
                    self._relay_in, self._burst = relay - 1, self._clock  # (the pair's add's)
                self._move(item, slot, b, m, tiebreak)
                return True
        if every:
            self._relay_in, self._burst = relay - 1, self._clock  # (the pair's add's, see add)
        if not -self._hi_b <= b <= self._hi_b:
            self._hi_b = abs(b)
        if not -self._hi_m <= m <= self._hi_m:
            self._hi_m = abs(m)
        self._b[slot], self._m[slot], self._tb[slot] = b, m, tiebreak
        hot = self._hot
        if slot in hot:
            if hot[-1] != slot:
                hot.remove(slot)
                hot.append(slot)
            self._epoch += 1
            return True
        if not self._seats:
            self._repair(slot)
            return True
        self._seat(slot, slot)
        return True

    def _move(self, item: K, slot: int, b: float, m: float, tiebreak: tuple[Any, ...]) -> None:
        """:meth:`renew` of ``item`` (in ``slot``) where the pair moves it: the
        bookkeeping of :meth:`remove_many` and :meth:`add` as they do it, then
        the tree's: without seats the repair of each in turn (the same tree,
        certificates and heap entries); with seats the item is seated in its
        new slot (no match replayed if it was seated already)."""
        pages = self._page_free
        page = slot // self._page
        free = pages[page]
        # remove_many's
        del self._slot[item]
        self._items[slot], self._tb[slot] = None, ()
        free.append(slot)
        self._num_free += 1
        if len(free) == 1:  # the page was full: list it as open (several pages here)
            self._open.append(page)
            if len(self._open) > 2 * len(pages) + 32:  # drop the full ones
                self._open = [p for p, f in enumerate(pages) if f]
        if not self._slot:
            self._hi_b = self._hi_m = 0.0  # no line left to bound
        # add's (a slot is free: no doubling)
        if not -self._hi_b <= b <= self._hi_b:
            self._hi_b = abs(b)
        if not -self._hi_m <= m <= self._hi_m:
            self._hi_m = abs(m)
        new = self._take(m)
        self._slot[item] = new
        self._items[new], self._b[new], self._m[new], self._tb[new] = item, b, m, tiebreak
        cap, win, hot = self._cap, self._win, self._hot
        if slot in hot:  # out of the tree already: seated in its new slot
            hot.remove(slot)
            hot.append(new)
            self._epoch += 1
            return
        if not self._seats:
            win[cap + slot] = -1
            self._repair(slot)  # remove's
            win[cap + new] = new
            self._repair(new)  # add's
            return
        self._seat(slot, new)

    def _seat(self, slot: int, new: int) -> None:
        """Take ``slot``'s leaf out of the tree and seat its item, now in slot
        ``new``; with every seat taken, the item seated longest goes back to
        its leaf first."""
        cap, win, hot = self._cap, self._win, self._hot
        win[cap + slot] = -1
        self._climb((cap + slot) >> 1, slot)  # the tree without it
        if len(hot) >= self._seats:
            cold = hot.pop(0)
            win[cap + cold] = cold
            self._climb((cap + cold) >> 1, cold)  # back in its leaf
        hot.append(new)
        self._epoch += 1
        if len(self._events) > 2 * cap + 32:
            self._compact_events()

    def _unseat(self) -> None:
        """Put every seated item back in its leaf: the tree an index without hot
        seats would hold (the same winners and certificates)."""
        cap, win = self._cap, self._win
        for slot in self._hot:
            win[cap + slot] = slot
            self._climb((cap + slot) >> 1, slot)
        self._hot = []
        self._epoch += 1

    def _with_hot(self, slot: int) -> int:
        """The winner of the tree's winner ``slot`` (-1: empty tree) and the
        seated items, matched at the clock in the order seated (:meth:`_match`'s
        winner, written out: every ``peek`` with a seat taken comes here)."""
        b, m, now = self._b, self._m, self._clock
        for h in self._hot:
            if slot < 0:
                slot = h
                continue
            ms, mh = m[slot], m[h]
            if ms < mh:  # slot is below h from tau on
                if now < (b[h] - b[slot]) / (ms - mh):
                    slot = h
            elif ms > mh:  # h is below slot from tau on
                if now >= (b[slot] - b[h]) / (mh - ms):
                    slot = h
            elif (b[h], self._tb[h], h) < (b[slot], self._tb[slot], slot):
                slot = h
        return slot

    def shares_page(self, item: K, others: Iterable[K]) -> bool:
        """Whether one of ``others`` holds a slot in the page of ``item``'s slot
        (the page a :meth:`remove` of ``item`` frees a slot in, and an
        :meth:`add` after removing several items takes the last freed slot of).
        With one page, whether ``others`` has any item. ValueError if absent."""
        page = self._page
        home = self._lookup(item) // page
        return any(self._lookup(x) // page == home for x in others)

    def remove(self, item: K) -> None:
        """Delete ``item``; ValueError if absent."""
        self.remove_many((item,))  # one item: its leaf is repaired as it goes

    def remove_many(self, items: Iterable[K]) -> None:
        """Delete each of ``items`` (distinct; ValueError at the first absent
        one, the earlier ones removed): the index ends as after :meth:`remove`
        of each in turn, the same winners, certificates and free slots, but a
        match above several removed leaves is replayed once, after all of
        them, not once per leaf."""
        removed = 0
        hot = self._hot
        seated = False
        try:
            for item in items:
                slot = self._lookup(item)
                del self._slot[item]
                self._items[slot], self._tb[slot] = None, ()
                self._win[self._cap + slot] = -1
                pages = self._page_free
                page = slot // self._page
                free = pages[page]
                free.append(slot)
                self._num_free += 1
                if len(free) == 1 and len(pages) > 1:  # the page was full: list it as open
                    self._open.append(page)
                    if len(self._open) > 2 * len(pages) + 32:  # drop the full ones
                        self._open = [p for p, f in enumerate(pages) if f]
                if hot and slot in hot:  # out of the tree already: no match to replay
                    hot.remove(slot)
                    seated = True
                    continue
                removed += 1
                if removed == 1:
                    first = slot
                elif removed == 2:
                    level = {(self._cap + first) >> 1, (self._cap + slot) >> 1}
                else:
                    level.add((self._cap + slot) >> 1)
        finally:  # also when an absent item stops the loop: the tree stays whole
            if not self._slot:
                self._hi_b = self._hi_m = 0.0  # no line left to bound
            if removed == 1:
                self._repair(first)
            elif removed:
                self._replay_levels(level)
                self._epoch += 1
                if len(self._events) > 2 * self._cap + 32:
                    self._compact_events()
            elif seated:
                self._epoch += 1

    def discard(self, item: K) -> None:
        """Delete ``item`` if present."""
        if item in self._slot:
            self.remove(item)

    def advance(self, now: float) -> None:
        """Move the clock to ``now``, replaying failed certificates in time order."""
        if type(now) is not float or not -_INF < now < _INF:  # _time's checks, past a float
            now = _time(now)
        clock = self._clock
        if now <= clock:
            if now < clock:
                raise ValueError(f"time went backwards: now={now!r} < index clock={clock!r}")
            return
        events = self._events
        if events and events[0][0] <= now:
            self._fail_until(now)
        self._clock = now
        self._epoch += 1
        if len(self._events) > 2 * self._cap + 32:  # _compact_events' own test, before the call
            self._compact_events()

    # --------------------------------------------------------------- internals

    def _lookup(self, item: K) -> int:
        slot = self._slot.get(item)
        if slot is None:
            raise ValueError(f"item {item!r} is not in the index")
        return slot

    def _match(self, a: int, c: int, now: float) -> tuple[int, float]:
        """Winner of slots ``a`` vs ``c`` at ``now`` and the time the loser overtakes it."""
        b, m = self._b, self._m
        ma, mc = m[a], m[c]
        if ma < mc:  # a is below c from tau on
            tau = (b[c] - b[a]) / (ma - mc)
            return (a, _INF) if now >= tau else (c, tau)
        if ma > mc:  # c is below a from tau on
            tau = (b[a] - b[c]) / (mc - ma)
            return (c, _INF) if now >= tau else (a, tau)
        tb = self._tb
        return (a, _INF) if (b[a], tb[a], a) < (b[c], tb[c], c) else (c, _INF)

    def _settle(self, node: int) -> None:
        """Replay ``node``'s match at the clock and schedule its certificate."""
        win = self._win
        a, c = win[2 * node], win[2 * node + 1]
        version = self._ver[node] + 1
        self._ver[node] = version
        if a < 0 or c < 0:
            win[node], self._cert[node] = (c if a < 0 else a), _INF
            return
        self.stats.comparisons += 1
        win[node], cert = self._match(a, c, self._clock)
        self._cert[node] = cert
        if cert < _INF:
            heappush(self._events, (cert, node, version))

    def _repair(self, slot: int) -> None:
        """Replay the matches from ``slot``'s leaf up while ``slot`` can affect them.

        Above a node whose winner is unchanged and is not ``slot``, nothing changed.
        """
        self._climb((self._cap + slot) >> 1, slot)
        self._epoch += 1
        if len(self._events) > 2 * self._cap + 32:
            self._compact_events()

    def _fail_until(self, now: float) -> None:
        """Replay, in time order, every certificate that fails at or before ``now``.

        Each is the failed node's match and those above it, replayed while the
        winner changes, at the failure's time: :meth:`_climb` written out again
        (the hot path of a clock advance while many keys cross). The caller
        sets the clock to ``now`` afterwards.
        """
        win, ver, cert, events = self._win, self._ver, self._cert, self._events
        b, m, tb = self._b, self._m, self._tb
        played = failed = 0
        while events and events[0][0] <= now:
            t, node, version = heappop(events)
            if version != ver[node]:
                continue  # stale: the node was settled again since
            failed += 1
            while node:  # _climb(node, None) at clock t
                old = win[node]
                a, c = win[2 * node], win[2 * node + 1]
                version = ver[node] + 1
                ver[node] = version
                if a < 0 or c < 0:
                    w, tau = (c if a < 0 else a), _INF
                else:
                    played += 1
                    ma, mc = m[a], m[c]
                    if ma < mc:
                        tau = (b[c] - b[a]) / (ma - mc)
                        w, tau = (a, _INF) if t >= tau else (c, tau)
                    elif ma > mc:
                        tau = (b[a] - b[c]) / (mc - ma)
                        w, tau = (c, _INF) if t >= tau else (a, tau)
                    else:
                        w = a if (b[a], tb[a], a) < (b[c], tb[c], c) else c
                        tau = _INF
                    if tau < _INF:
                        heappush(events, (tau, node, version))
                win[node], cert[node] = w, tau
                if w == old:
                    break
                node >>= 1
        self.stats.events += failed
        self.stats.comparisons += played

    def _climb(self, node: int, slot: int | None) -> None:
        """:meth:`_settle` ``node`` and its ancestors in turn, at the clock, until
        one's winner is unchanged and is not ``slot`` (or the root is done).

        This is :meth:`_settle` and :meth:`_match` written out (the hot path of
        every add, update, remove and certificate failure); they must agree.
        """
        win, ver, cert, events = self._win, self._ver, self._cert, self._events
        b, m, tb, now = self._b, self._m, self._tb, self._clock
        played = 0
        while node:
            old = win[node]
            a, c = win[2 * node], win[2 * node + 1]
            version = ver[node] + 1
            ver[node] = version
            if a < 0 or c < 0:
                w, tau = (c if a < 0 else a), _INF
            else:
                played += 1
                ma, mc = m[a], m[c]
                if ma < mc:  # a is below c from tau on
                    tau = (b[c] - b[a]) / (ma - mc)
                    w, tau = (a, _INF) if now >= tau else (c, tau)
                elif ma > mc:  # c is below a from tau on
                    tau = (b[a] - b[c]) / (mc - ma)
                    w, tau = (c, _INF) if now >= tau else (a, tau)
                else:
                    w = a if (b[a], tb[a], a) < (b[c], tb[c], c) else c
                    tau = _INF
                if tau < _INF:
                    heappush(events, (tau, node, version))
            win[node], cert[node] = w, tau
            if w == old != slot:
                break
            node >>= 1
        self.stats.comparisons += played

    def _replay_levels(self, level: set[int]) -> None:
        """Replay the matches at the nodes ``level`` (all at one depth) and,
        level by level, those above whose winner may have changed: a node is
        replayed once its children are, and its parent only if its winner
        changed (the parent's match is then the same as before). At the clock.

        :meth:`_settle` for several leaves at once, level by level (it runs once
        per batch of removals, so the call per node is not written out as in
        :meth:`_climb`); the tree ends in the one state every node's match at the
        clock determines, as after climbing from each leaf in turn.
        """
        win, settle = self._win, self._settle
        while level:
            up: set[int] = set()
            for node in level:
                old = win[node]
                settle(node)
                if win[node] != old and node > 1:
                    up.add(node >> 1)
            level = up

    def _take(self, slope: float) -> int:
        """A free slot for a line of ``slope`` (there is one): in the page laid
        out for that slope, else in the nearest page with one within
        ``_NEAR_PAGES``, else in any page (one listed in ``_open``)."""
        pages = self._page_free
        if len(pages) == 1:  # a small index: one page, and a free slot in it
            self._num_free -= 1
            return pages[0].pop()
        p = bisect_right(self._page_lo, slope) - 1
        if p < 0:
            p = 0
        free = pages[p]
        if not free:
            last = len(pages) - 1
            for d in range(1, _NEAR_PAGES + 1):
                if p >= d and pages[p - d]:
                    free = pages[p - d]
                    break
                if p + d <= last and pages[p + d]:
                    free = pages[p + d]
                    break
            else:
                listed = self._open
                while not pages[listed[-1]]:  # a page filled since it was listed
                    listed.pop()
                free = pages[listed[-1]]
        self._num_free -= 1
        return free.pop()

    def _grow(self) -> None:
        """Double the capacity, lay the items out again and replay every match
        (:meth:`_lay_out`). Amortised O(log n) per add."""
        self._lay_out(2 * self._cap)
        self.stats.rebuilds += 1

    def _lay_out(self, cap: int) -> None:
        """Lay the items out in ``cap`` slots (at least as many) and replay every match.

        Amortised O(log n) per add (at a doubling, and again once a burst of
        adds reaches one in ``_RELAY_SHARE`` of the items placed here, when at
        least ``_RELAY_MIN``: see :meth:`add`). The items are placed in order of slope
        (then intercept), spread evenly over pages of ``_PAGE`` slots (half
        filling them at a doubling), and a later
        item goes into the page laid out for its slope (:meth:`_take`): the
        leaves under a low node then hold lines of nearly equal slope, which
        cross seldom, so far fewer certificates fail than with leaves in order
        of arrival (lines that arrive together with nearly equal keys and
        different slopes cross soon, and in a tree ordered by arrival nearly
        every low node holds such a pair). Where the leaves lie changes no
        winner but between keys within rounding error of each other.
        """
        b, m, items, tb = self._b, self._m, self._items, self._tb
        order = sorted(self._slot.values(), key=lambda s: (m[s], b[s], s))
        page = min(_PAGE, cap)
        npages = cap // page
        n = len(order)
        new_b, new_m = [0.0] * cap, [0.0] * cap
        new_items: list[Any] = [None] * cap
        new_tb: list[tuple[Any, ...]] = [()] * cap
        win = [-1] * (2 * cap)
        page_free: list[list[int]] = []
        page_lo: list[float] = []
        slots = self._slot
        i = 0
        for p in range(npages):
            end = (p + 1) * n // npages
            base = p * page
            if i < end:
                page_lo.append(m[order[i]])
            elif page_lo:  # no item here (n < npages): the previous page's slopes
                page_lo.append(page_lo[-1])
            else:
                page_lo.append(-_INF)
            slot = base
            for old_slot in order[i:end]:
                item = items[old_slot]
                slots[item] = slot
                new_items[slot], new_b[slot], new_m[slot] = item, b[old_slot], m[old_slot]
                new_tb[slot] = tb[old_slot]
                win[cap + slot] = slot
                slot += 1
            page_free.append(list(range(base + page - 1, slot - 1, -1)))
            i = end
        self._items, self._b, self._m, self._tb = new_items, new_b, new_m, new_tb
        self._page, self._page_free, self._page_lo = page, page_free, page_lo
        self._open = [p for p, f in enumerate(page_free) if f]
        self._num_free = cap - n
        self._win, self._ver, self._cert, self._events = win, [0] * cap, [_INF] * cap, []
        self._hot = []  # every item in its new leaf
        self._cap = cap
        self._settle_all()
        self._refresh_bounds()
        self._relay_every = self._relay_in = max(1, n // _RELAY_SHARE) if n >= _RELAY_MIN else 0
        self._epoch += 1

    def _settle_all(self) -> None:
        """:meth:`_settle` of every node, the deepest first, on a tree whose
        versions are all 0 and whose heap is empty (a fresh layout's).

        :meth:`_settle` and :meth:`_match` written out (a layout replays every
        match: the call per node was half its time); they must agree
        (twin-tested in ``tests/sched/test_index_relayout.py``): the same
        winners, certificates, versions, heap and comparison count."""
        win, ver, certs, events = self._win, self._ver, self._cert, self._events
        b, m, tb, now = self._b, self._m, self._tb, self._clock
        played = 0
        for node in range(self._cap - 1, 0, -1):
            a, c = win[2 * node], win[2 * node + 1]
            ver[node] = 1  # (0 + 1)
            if a < 0 or c < 0:
                win[node] = c if a < 0 else a  # (its certificate stays _INF)
                continue
            played += 1
            ma, mc = m[a], m[c]
            if ma < mc:  # a is below c from tau on
                tau = (b[c] - b[a]) / (ma - mc)
                if now >= tau:
                    win[node] = a
                    continue
                win[node] = c
            elif ma > mc:  # c is below a from tau on
                tau = (b[a] - b[c]) / (mc - ma)
                if now >= tau:
                    win[node] = c
                    continue
                win[node] = a
            else:
                win[node] = a if (b[a], tb[a], a) < (b[c], tb[c], c) else c
                continue
            if tau < _INF:  # (a crossing past the float range never comes)
                certs[node] = tau
                heappush(events, (tau, node, 1))
        self.stats.comparisons += played

    def _compact_events(self) -> None:
        """Drop stale heap entries once they outnumber the nodes (and refresh
        the ``count_ahead`` bound: O(n), no more than the compaction's O(cap),
        which comes after at least ``cap + 32`` heap pushes)."""
        if len(self._events) > 2 * self._cap + 32:
            ver = self._ver
            self._events = [(c, n, ver[n]) for n, c in enumerate(self._cert) if c < _INF]
            heapify(self._events)
            self._refresh_bounds()

    def _refresh_bounds(self) -> None:
        """Set ``_hi_b`` / ``_hi_m`` to the largest ``|intercept|`` / ``|slope|``
        of the lines in the index (0.0 when empty): a line that left, however
        extreme, no longer widens :meth:`count_ahead`'s margin."""
        slots = self._slot.values()
        self._hi_b = max(map(abs, map(self._b.__getitem__, slots)), default=0.0)
        self._hi_m = max(map(abs, map(self._m.__getitem__, slots)), default=0.0)

    def _best_first(self) -> Iterator[K]:
        """Best-first enumeration over subtrees (see the module docstring).

        A seated item is a subtree of its own (node ``~slot``). The first item
        is :meth:`peek`'s (the root's winner matched against the seats, as
        the tree would match them), the rest come in heap order: so with
        seats as without, the first item yielded is the one ``peek`` gives."""
        epoch, now, cap, win = self._epoch, self._clock, self._cap, self._win
        b, m, tb, items, stats = self._b, self._m, self._tb, self._items, self.stats
        heap: list[tuple[float, float, float, tuple[Any, ...], int]]
        hot, root = self._hot, win[1]
        # the first subtree popped is known (peek's): it goes first without the heap
        node: int | None = None if root < 0 else 1
        if hot:
            first = self._with_hot(root)
            if first != root:
                node = ~first
            # each seat's entry, and the root's if it does not go first
            heap = [(b[s] + m[s] * now, m[s], b[s], tb[s], ~s) for s in hot if s != first]
            if node != 1 and root >= 0:
                heap.append((b[root] + m[root] * now, m[root], b[root], tb[root], 1))
            heapify(heap)
            stats.key_evals += len(hot)
        else:
            heap = []
        if root >= 0:
            stats.key_evals += 1  # (its key is the heap's, had it gone through it)
        while node is not None or heap:
            if node is None:
                node = heappop(heap)[4]
            if node < 0:
                yield items[~node]
                if self._epoch != epoch:
                    raise RuntimeError("KineticIndex was modified while iter_sorted was running")
                node = None
                continue
            s = win[node]
            yield items[s]
            if self._epoch != epoch:
                raise RuntimeError("KineticIndex was modified while iter_sorted was running")
            leaf = cap + s
            top, node = node, None
            pushed = len(heap)
            for shift in range(leaf.bit_length() - top.bit_length() - 1, -1, -1):
                sib = (leaf >> shift) ^ 1
                if (w := win[sib]) >= 0:
                    heappush(heap, (b[w] + m[w] * now, m[w], b[w], tb[w], sib))
            stats.key_evals += len(heap) - pushed

    # ----------------------------------------------------------------- testing

    def check(self) -> None:
        """Verify every invariant by brute force at the clock; AssertionError if broken."""
        self._check_leaves()
        cap, win, now = self._cap, self._win, self._clock
        live = {e for e in self._events if e[2] == self._ver[e[1]]}
        best = [_INF] * (2 * cap)  # brute-force minimum key per subtree
        for slot in range(cap):
            if win[cap + slot] >= 0:
                best[cap + slot] = self._b[slot] + self._m[slot] * now
        for node in range(cap - 1, 0, -1):
            best[node] = min(best[2 * node], best[2 * node + 1])
            self._check_node(node, live, best[node])

    def _check_leaves(self) -> None:
        cap, win, hot = self._cap, self._win, self._hot
        _require(len(hot) == len(set(hot)) <= self._seats, "hot seats repeated or too many")
        _require(all(win[cap + s] == -1 for s in hot), "a seated item is in the tree")
        occupied = {s for s in range(cap) if win[cap + s] >= 0}.union(hot)
        _require(all(win[cap + s] in (s, -1) for s in range(cap)), "leaf winner is not its slot")
        _require(occupied == set(self._slot.values()), "occupied leaves differ from the items")
        free = [s for page in self._page_free for s in page]
        page = self._page
        _require(len(self._page_free) * page == cap, "the pages do not cover the leaves")
        _require(
            all(s // page == p for p, page_slots in enumerate(self._page_free) for s in page_slots),
            "a free slot is listed under another page",
        )
        _require(len(free) == len(set(free)) == self._num_free, "free slots miscounted")
        _require(occupied.isdisjoint(free), "a free slot is occupied")
        listed = set(self._open)
        _require(
            all(p in listed for p, f in enumerate(self._page_free) if f),
            "a page with a free slot is not listed as open",
        )
        _require(len(occupied) + len(free) == cap, "slots lost from the free lists")
        for item, slot in self._slot.items():
            _require(self._items[slot] == item, f"slot {slot} does not hold item {item!r}")
            _require(
                abs(self._b[slot]) <= self._hi_b and abs(self._m[slot]) <= self._hi_m,
                f"the count_ahead bound does not cover item {item!r}",
            )

    def _check_node(self, node: int, live: set[tuple[float, int, int]], best: float) -> None:
        win, now = self._win, self._clock
        a, c = win[2 * node], win[2 * node + 1]
        if a < 0 or c < 0:
            want, cert = (c if a < 0 else a), _INF
        else:
            want, cert = self._match(a, c, now)
        _require(win[node] == want, f"node {node}: winner {win[node]} but the match gives {want}")
        _require(self._cert[node] == cert, f"node {node}: certificate {self._cert[node]} != {cert}")
        if cert < _INF:
            _require(cert > now, f"node {node}: certificate {cert} is not after the clock {now}")
            _require((cert, node, self._ver[node]) in live, f"node {node}: certificate unscheduled")
        if want >= 0:
            b, m = self._b[want], self._m[want]
            slack = _CHECK_RTOL * max(1.0, abs(b) + abs(m * now))
            _require(b + m * now <= best + slack, f"node {node}: winner is not the subtree minimum")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
