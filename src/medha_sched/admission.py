"""Predictive admission: will a new request meet its TTFT SLO under the current queue?

The engine side takes a :class:`QueueSnapshot` now and then
(:class:`SnapshotTaker`): every request still prefilling, with its LARS key
as the scheduler computes it and its remaining prefill time under the
*current* cost model, plus prefill-time tables sampled at a few lengths. The
front end (the HTTP process) keeps the latest snapshot in an
:class:`AdmissionController` and, for a request with a TTFT SLO, predicts its
TTFT without asking the engine (microseconds):

* its prefill alone, ``C(P)``, from the table;
* the work ahead of it under LARS: queued prefills whose relative slack
  ``rho = (deadline - now - remaining) / total`` is at most the new request's
  ``(D - C(P)) / C(P)``, including requests admitted since the snapshot;
* minus the work done since the snapshot was taken;
* all stretched by ``slowdown``: a step's budget T shared with the running
  decodes leaves ``T - decode`` for prefill.

``decide`` accepts requests without an SLO and those predicted to meet it.
Everything is in seconds on one monotonic clock (the caller's ``now``;
snapshots store times relative to when they were taken).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from medha_sched.cost.base import BatchWork, CostModel
from medha_sched.prefill_cache import PrefillTimeCache
from medha_sched.request import Request

#: prompt lengths the tables are sampled at (plus the maximum), ~10% apart
_MIN_SAMPLE = 16


@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """One request still prefilling, as admission sees it.

    Attributes:
        remaining_s: predicted prefill seconds left (current cost model, alone).
        rho0: its LARS key at the snapshot time.
        rate: how fast its key falls per second (``1 / total work``).
        deadline: its TTFT deadline, seconds after the snapshot (``inf``: no SLO).
    """

    remaining_s: float
    rho0: float
    rate: float
    deadline: float = math.inf

    def rho(self, elapsed: float) -> float:
        return self.rho0 - self.rate * elapsed


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueSnapshot:
    """The engine's prefill queue at one instant.

    Attributes:
        taken_at: the clock (seconds) when it was taken.
        queue: requests still prefilling.
        lengths: prompt lengths the tables are sampled at (increasing, from 0).
        prefill_s: ``C(L)`` under the current cost model at ``lengths``.
        key_s: ``C(L)`` as the scheduler prices it for LARS keys.
        slowdown: wall seconds per second of alone-prefill work (>= 1).
        target_time: the step budget T.
    """

    taken_at: float
    queue: tuple[QueuedPrefill, ...]
    lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]
    key_s: tuple[float, ...]
    slowdown: float = 1.0
    target_time: float = 0.05

    def prefill_time(self, num_tokens: int) -> float:
        """``C(num_tokens)`` under the current model (linear between samples)."""
        return _interp(self.lengths, self.prefill_s, num_tokens)

    def key_time(self, num_tokens: int) -> float:
        return _interp(self.lengths, self.key_s, num_tokens)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Admission's answer for one request.

    Attributes:
        accept: whether to run it.
        predicted_ttft: predicted seconds to its first token (None: no prediction).
        retry_after: for a rejection, seconds after which a retry may fit.
    """

    accept: bool
    predicted_ttft: float | None = None
    retry_after: float = 0.0


@dataclass
class AdmissionController:
    """Predicts TTFT at arrival from the latest snapshot and rejects hopeless requests.

    The queue (snapshot plus requests admitted since) is ordered by LARS key
    now, the work done since the snapshot is taken off its head, and the new
    request is placed by its own key. Its predicted TTFT is the work up to and
    including it, times ``slowdown``. With ``reject``, it is refused when that
    exceeds its SLO, or when running it first would make a queued request with
    an SLO miss a deadline it would otherwise meet.

    Args:
        reject: False predicts only (every request is accepted).
        margin: deadlines are checked against ``margin * slo`` (1: as given).
    """

    reject: bool = True
    margin: float = 1.0
    snapshot: QueueSnapshot | None = None
    #: (admitted at, entry with an absolute deadline) since the snapshot was taken
    _pending: list[tuple[float, QueuedPrefill]] = field(default_factory=list)

    def update(self, snapshot: QueueSnapshot) -> None:
        """A new snapshot; requests admitted well before it are now in its queue."""
        self.snapshot = snapshot
        horizon = snapshot.taken_at - 0.005  # what the engine had received by then
        self._pending = [(t, q) for t, q in self._pending if t >= horizon]

    def _queue(self, now: float) -> list[tuple[float, float, float]]:
        """``(key now, remaining seconds, absolute deadline)``, in LARS order, with the
        work done since the snapshot taken off the head."""
        snap = self.snapshot
        assert snap is not None
        elapsed = max(0.0, now - snap.taken_at)
        queue = sorted(
            (q.rho(elapsed), q.remaining_s, snap.taken_at + q.deadline) for q in snap.queue
        )
        done = elapsed / snap.slowdown
        trimmed = []
        for rho, rem, deadline in queue:
            cut = min(rem, done)
            done -= cut
            if rem - cut > 0:
                trimmed.append((rho, rem - cut, deadline))
        trimmed += [(q.rho(now - t), q.remaining_s, q.deadline) for t, q in self._pending]
        trimmed.sort()
        return trimmed

    def predict(self, num_tokens: int, ttft_slo: float, now: float) -> float | None:
        """Predicted TTFT (seconds) of a request arriving ``now``; None without a snapshot."""
        if self.snapshot is None:
            return None
        return self._place(num_tokens, ttft_slo, now)[0]

    def _place(self, num_tokens: int, ttft_slo: float, now: float) -> tuple[float, bool]:
        """(predicted TTFT, whether a queued request would be pushed past its deadline)."""
        snap = self.snapshot
        assert snap is not None
        p = snap.prefill_time(num_tokens)
        w = max(snap.key_time(num_tokens), 1e-9)
        rho_new = (ttft_slo - w) / w
        ahead = 0.0
        ttft = None
        displaces = False
        for rho, rem, deadline in self._queue(now):
            if ttft is None and rho > rho_new:
                ttft = (ahead + p) * snap.slowdown
            finish = now + (ahead + rem) * snap.slowdown
            if ttft is not None:
                # behind the new request: does it push this one past its deadline?
                slack = (deadline - now) * self.margin
                if finish - now <= slack < finish - now + p * snap.slowdown:
                    displaces = True
            ahead += rem
        if ttft is None:
            ttft = (ahead + p) * snap.slowdown
        return ttft, displaces

    def decide(self, num_tokens: int, ttft_slo: float | None, now: float) -> Verdict:
        """Accept or reject a request of ``num_tokens`` prompt tokens arriving ``now``."""
        if ttft_slo is None or self.snapshot is None:
            return Verdict(True)
        snap = self.snapshot
        ttft, displaces = self._place(num_tokens, ttft_slo, now)
        if self.reject and (ttft > self.margin * ttft_slo or displaces):
            p = snap.prefill_time(num_tokens) * snap.slowdown
            return Verdict(False, ttft, retry_after=max(ttft - ttft_slo, p))
        w = max(snap.key_time(num_tokens), 1e-9)
        entry = QueuedPrefill(
            snap.prefill_time(num_tokens), (ttft_slo - w) / w, 1.0 / w, now + ttft_slo
        )
        self._pending.append((now, entry))
        return Verdict(True, ttft)


class SnapshotTaker:
    """Builds :class:`QueueSnapshot` s on the engine side.

    The prefill table under the current cost model is rebuilt at most every
    ``refresh_s`` seconds (a frozen copy of an online model, so it is
    consistent), and sampled at ~10% length steps up to ``max_tokens``.

    Args:
        model: the scheduler's cost model (it may be learning).
        key_cache: the scheduler's own prefill-time cache (LARS keys use it).
        target_time, token_grid, max_chunk_tokens, group_token_limit: the
            scheduler's settings (see :class:`~medha_sched.config.SchedulerConfig`).
        max_tokens: the longest prompt to sample.
    """

    def __init__(
        self,
        model: CostModel,
        key_cache: PrefillTimeCache,
        *,
        target_time: float,
        token_grid: int,
        max_chunk_tokens: int,
        group_token_limit: int,
        max_tokens: int,
        refresh_s: float = 1.0,
    ) -> None:
        self._model = model
        self._key_cache = key_cache
        self._settings = {
            "target_time": target_time,
            "token_grid": token_grid,
            "max_chunk_tokens": max_chunk_tokens,
            "group_token_limit": group_token_limit,
        }
        self.target_time = target_time
        self.lengths = _sample_lengths(max_tokens)
        self.refresh_s = refresh_s
        self._built_at = -math.inf
        self._cache: PrefillTimeCache | None = None
        self._prefill_s: tuple[float, ...] = ()
        self._key_s = tuple(key_cache.prefill_time(n) for n in self.lengths)
        self._key_revision = key_cache.revision

    def _fresh_cache(self, now: float) -> PrefillTimeCache:
        if self._cache is None or now - self._built_at >= self.refresh_s:
            frozen = getattr(self._model, "frozen", None)
            model = frozen() if callable(frozen) else self._model
            self._cache = PrefillTimeCache(model, **self._settings, initial_tokens=1024)
            self._prefill_s = tuple(self._cache.prefill_time(n) for n in self.lengths)
            self._built_at = now
        return self._cache

    def take(
        self,
        requests: Iterable[Request],
        *,
        now: float,
        engine_now: float,
        overhead: float = 1.0,
    ) -> QueueSnapshot:
        """Snapshot ``requests`` (the engine's unfinished ones) at clock ``now``.

        ``engine_now`` is the scheduler's clock at the same instant (deadlines
        are on it); ``overhead`` (>= 1) is wall time per executor second of a
        step (scheduling, streaming).
        """
        cache = self._fresh_cache(now)
        if self._key_revision != self._key_cache.revision:  # the scheduler re-priced
            self._key_revision = self._key_cache.revision
            self._key_s = tuple(self._key_cache.prefill_time(n) for n in self.lengths)
        queue = []
        decodes = []
        for r in requests:
            if r.status.finished:
                continue
            if r.is_prefilling:
                done = r.num_computed_tokens
                total = max(r.total_work, 1e-9)
                rho0 = (r.deadline - engine_now - r.remaining_work) / total
                remaining = cache.remaining_time(r.num_prefill_tokens, done)
                deadline = r.deadline - engine_now if r.ttft_slo is not None else math.inf
                queue.append(QueuedPrefill(remaining, rho0, 1.0 / total, deadline))
            else:
                decodes.append((1, r.num_tokens))
        slowdown = max(1.0, overhead) if math.isfinite(overhead) else 1.0
        if decodes:
            model = self._model
            extra = model.predict(BatchWork.single_group(*decodes)) - model.predict(
                BatchWork.single_group((1, 0))
            )
            t = self.target_time
            slowdown *= t / max(t - max(extra, 0.0), 0.1 * t)
        return QueueSnapshot(
            taken_at=now,
            queue=tuple(queue),
            lengths=self.lengths,
            prefill_s=self._prefill_s,
            key_s=self._key_s,
            slowdown=slowdown,
            target_time=self.target_time,
        )


def _sample_lengths(max_tokens: int) -> tuple[int, ...]:
    """0, then 16, 32, ... growing ~10% a step, ending at ``max_tokens``."""
    out = [0]
    n = _MIN_SAMPLE
    while n < max_tokens:
        out.append(n)
        n = max(n + _MIN_SAMPLE, int(n * 1.1))
    out.append(max(max_tokens, 1))
    return tuple(out)


def _interp(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """Piecewise-linear ``ys`` at ``x``; beyond the last sample, grows quadratically."""
    if x <= 0:
        return 0.0
    last = xs[-1]
    if x >= last:
        return ys[-1] * (x / last) ** 2 if last > 0 else ys[-1]
    k = bisect.bisect_right(xs, x)
    x0, x1 = xs[k - 1], xs[k]
    y0, y1 = ys[k - 1], ys[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


__all__ = [
    "AdmissionController",
    "QueueSnapshot",
    "QueuedPrefill",
    "SnapshotTaker",
    "Verdict",
]
