"""An online cost model: affine features whose coefficients learn from every executed step.

Per KVP group, with the sums taken over the requests the group holds::

    time = step + per_request * requests + per_token * (query tokens of tail items)
                + per_kv * (KV tokens read) + per_attn * sum(q_tokens * kv_attended)

``kv_attended`` (and the KV read) is ``kv_tokens + q_tokens`` on a request's
tail group and ``kv_tokens`` on groups that only attend, so a decode reads
``kv + 1`` entries and a prefill chunk attends ``q * (kv + q)`` pairs. A batch
costs its slowest group. Every coefficient is kept >= 0 (``step`` > 0), so a
prediction is finite, positive for a non-empty batch and non-decreasing in
query and KV tokens.

:meth:`OnlineCostModel.observe` takes an executed batch and its measured
seconds and updates the coefficients by weighted recursive least squares on the
residual relative to the prediction, ``measured / predicted - 1`` (weights that
do not depend on the measurement, so the fit tracks the mean step time, not a
low quantile), with exponential forgetting. The update is O(features^2)
(a 5 x 5 matrix, pure Python, a few tens of microseconds) and holds no history
beyond the last 100 errors. It is robust:

* how far off a step is, is judged on the log ratio ``ln(measured /
  predicted)`` (symmetric: 20x too high is as far off as 20x too low; the
  relative residual of an over-prediction cannot pass -1, so a class of steps
  predicted 20x too high once looked ordinary and was never flagged);
* residuals beyond ``huber`` robust scales are down-weighted (Huber), and a
  lone residual beyond ``reject`` scales (a pause, a page fault) is ignored;
* ``drift_steps`` consecutive large residuals of one sign are a change of
  regime (another process took cores, contexts past the calibrated range):
  every coefficient is rescaled by the streak's median ratio (at most 16x at
  once) and the covariance is reset around them so they re-converge in a few
  steps;
* the same streaks are kept per class of step (query tokens of the slowest
  group, by factors of 4: decodes, small chunks, long chunks, ...), so a
  class that is persistently off is relearned even when well-predicted steps
  of another class come between its steps (a CPU hog slows one-token steps
  and long chunks very differently): what repeats is no outlier; its step is
  learned at full weight around a reset covariance, whose gain goes to the
  terms that dominate that class;
* the robust scale measures the noise around each class's own recent level
  (an EWMA of its log ratios), not how far a class is off: when it also
  absorbed a class's bias, a class predicted 10x too high inflated the scale
  until its residuals looked ordinary and were never flagged;
* the covariance trace is capped, so unexcited directions cannot wind up;
* groups of one-token work (decodes) are priced by a decode anchor, a fit of
  ``step + per_request * n (+ first)`` learned from one-token steps alone
  (with the shared fit's KV terms): the shared fit is dominated by the
  chunk steps around them, and its ``step`` moved with every chunk it
  mispredicted, pricing the one-token steps between chunks up to 2x off;
  ``first`` prices the first step after a chunk (caches the chunk evicted).
  Any other group costs at least the anchor's price of its requests, so
  predictions stay monotone. Once the anchor exists, a one-token step is
  judged for drift by the anchor's price: the shared fit, which may price
  them far off, is not rescaled by a run of them (it still learns from
  those it prices within its robust bounds); a run of them off the anchor's
  price rescales the anchor alone.

The model is mutable: the scheduler prices batches with the current
coefficients (``group_time`` reads them), while the features stay integers
and affine in the KV length for one-token work, as the decode lanes need.
State saves to JSON (:meth:`save`) and loads with the spec ``online:FILE``,
so ``medha-sim`` predicts with what a server learned.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import ClassVar

from medha_sched.config import ParallelDegrees
from medha_sched.cost.base import AggregateCostModel, BatchWork, CostModel
from medha_sched.cost.registry import DEFAULT_LAYOUT, check_spec_keys, parse_cost_model_spec

#: names of the coefficients, in state order (``step`` is the per-group constant)
COEFFICIENTS = ("step", "per_request", "per_token", "per_kv", "per_attn")
#: feature units the coefficients are kept in (conditioning): seconds per unit
_UNITS = (1.0, 1.0, 256.0, 8192.0, 256.0 * 8192.0)
_KIND = "medha-online-cost-model"
_VERSION = 2  # 2: the decode anchor ("decode"); version 1 states still load
_MIN_STEP = 1e-6
_MAX_COEF = 1e6  # seconds per unit: far beyond any real device, keeps state finite
_ERROR_WINDOW = 100
#: the decode anchor (see ``OnlineCostModel._learn_decode``): its forgetting
#: factor (memory about 10 one-token steps), how loose its covariance starts
#: (times the shared fit's), after how many steps with a chunk in a row it
#: relearns around fresh covariance, and the bound on one step's log ratio
#: once it is an outlier (a pause moves it, but by at most 2x)
_DEC_FORGET = 0.9
_DEC_PRIOR = 10.0
_DEC_GAP = 20
_DEC_CLIP = math.log(2.0)
#: a drift rescales every coefficient by at most this factor (as a log) at once
_MAX_DRIFT_LOG = math.log(16.0)
#: classes of steps for per-class drift: query tokens of the slowest group by factors of 4
_CLASSES = 8
#: typical work, as feature totals in units of ``_UNITS`` (a 32-request decode
#: at 4K context, a 512-token chunk at KV 0 and at KV 32K, a 16-token prompt), whose predicted
#: times decide when the coefficients have moved enough to bump ``revision``
_PROBES = (
    (1.0, 32.0, 32 / 256, 32 * 4097 / 8192, 32 * 4097 / (256 * 8192)),
    (1.0, 1.0, 2.0, 512 / 8192, 512 * 512 / (256 * 8192)),
    (1.0, 1.0, 2.0, 33280 / 8192, 512 * 33280 / (256 * 8192)),
    (1.0, 1.0, 16 / 256, 16 / 8192, 16 * 16 / (256 * 8192)),
)
#: relative change of any probe's predicted time that makes a new revision
REVISION_THRESHOLD = 0.05


class OnlineCostModel(AggregateCostModel):
    """Affine cost per group whose coefficients follow measured step times.

    Args:
        coefficients: initial ``(step, per_request, per_token, per_kv, per_attn)``
            in seconds per raw unit (per group, request, token, KV token, pair).
        layout: the parallel layout the model describes.
        forget: RLS forgetting factor in (0, 1]; memory is about ``1/(1-forget)`` steps.
        prior_strength: how many steps' worth of evidence the initial
            coefficients count for (smaller learns faster).
        huber: residuals beyond this many robust scales are down-weighted.
        reject: a lone residual beyond this many robust scales is ignored.
        drift_steps: this many large same-sign residuals in a row reset the covariance.
    """

    num_features: ClassVar[int] = 4
    affine_decode_features: ClassVar[bool] = True

    def __init__(
        self,
        coefficients: Sequence[float],
        *,
        layout: ParallelDegrees = DEFAULT_LAYOUT,
        forget: float = 0.98,
        prior_strength: float = 1.0,
        huber: float = 3.0,
        reject: float = 8.0,
        drift_steps: int = 3,
    ) -> None:
        if not isinstance(layout, ParallelDegrees):
            raise ValueError(f"layout must be a ParallelDegrees, got {layout!r}")
        if len(coefficients) != len(COEFFICIENTS):
            raise ValueError(
                f"coefficients must be {len(COEFFICIENTS)} numbers {COEFFICIENTS}, "
                f"got {coefficients!r}"
            )
        for name, value in zip(COEFFICIENTS, coefficients, strict=True):
            if not _finite_number(value) or value < 0:
                raise ValueError(f"coefficient {name} must be a finite number >= 0, got {value!r}")
        if not _finite_number(forget) or not 0.5 <= forget <= 1.0:
            raise ValueError(f"forget must be in [0.5, 1], got {forget!r}")
        if not _finite_number(prior_strength) or prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength!r}")
        if not _finite_number(huber) or huber <= 0:
            raise ValueError(f"huber must be > 0, got {huber!r}")
        if not _finite_number(reject) or reject < huber:
            raise ValueError(f"reject must be >= huber ({huber}), got {reject!r}")
        if not isinstance(drift_steps, int) or drift_steps < 1:
            raise ValueError(f"drift_steps must be an integer >= 1, got {drift_steps!r}")
        self.layout = layout
        self.forget = float(forget)
        self.prior_strength = float(prior_strength)
        self.huber = float(huber)
        self.reject = float(reject)
        self.drift_steps = drift_steps
        # theta: coefficients in units of _UNITS (all of order the step time)
        theta = [float(c) * u for c, u in zip(coefficients, _UNITS, strict=True)]
        theta[0] = max(theta[0], _MIN_STEP)
        self._theta = theta
        self._p: list[list[float]] = []
        self._p_cap = 0.0
        self._reset_covariance()
        self._scale = 0.05  # robust scale of log ratios (EWMA of clipped |ln(measured/predicted)|)
        self._streak = 0  # consecutive large residuals of one sign (signed count)
        self._streak_residuals: list[float] = []
        #: how many of the open streak's steps were one-token steps the anchor priced
        self._streak_anchored = 0
        #: per class of step (:func:`_step_class`): signed streak count, last log ratios
        self._class_streaks: dict[int, tuple[int, tuple[float, ...]]] = {}
        #: per class of step: recent level of its log ratios (EWMA)
        self._class_centers: dict[int, float] = {}
        self.steps = 0  # observations accepted into the fit
        self.drifts = 0  # covariance resets on a change of regime
        self.errors: deque[float] = deque(maxlen=_ERROR_WINDOW)
        #: if set, ``step + per_request`` is held at or below it (seconds): a
        #: scheduler whose budget T a lone one-token step cannot meet forms no
        #: batch at all, so the runtime sets this to T/2 to stay live when the
        #: device slows down past what T allows
        self.fixed_cost_cap: float | None = None
        #: bumped whenever some probe's predicted time has moved more than
        #: :data:`REVISION_THRESHOLD` since the last bump: tables derived from
        #: the model (the scheduler's prefill times) rebuild when it changes
        self.revision = 0
        self._revision_times: tuple[float, ...] = ()
        #: the decode anchor: ``(step, per_request, first)`` (seconds), learned
        #: from one-token steps only (None until one is seen); the KV terms are
        #: the shared fit's (see :meth:`_decode_features`)
        self._dec: list[float] | None = None
        self._dec_p: list[list[float]] = []
        #: log ratios of the last one-token steps far off in a row (one sign)
        self._dec_out: list[float] = []
        #: ``(step, per_request, first or 0)`` of the anchor as ``group_time`` reads them
        self._dec_coef: tuple[float, float, float] | None = None
        #: 0 when the last step observed had a chunk, else 1
        self._dec_since = 1
        #: steps with a chunk observed since the last one-token step
        self._dec_idle = 0
        #: 0 when the last batch issued (:meth:`note_issued`) had a chunk, else 1;
        #: None until one is noted (pricing then follows the last step observed)
        self._issued_since: int | None = None
        self._sync()

    # ------------------------------------------------------------ prediction
    @property
    def coefficients(self) -> dict[str, float]:
        """Current coefficients in seconds per raw unit."""
        return dict(zip(COEFFICIENTS, self._coef, strict=True))

    def features(self, q_tokens: int, kv_tokens: int, tail: bool) -> tuple[float, ...]:
        """``(1, tail tokens, KV read, q * kv_attended)`` of one request on one group."""
        if tail:
            kv = kv_tokens + q_tokens
            return (1, q_tokens, kv, q_tokens * kv)
        return (1, 0, kv_tokens, q_tokens * kv_tokens)

    def group_time(self, totals: Sequence[float]) -> float:
        """``step + per_request*n + per_token*tokens + per_kv*kv + per_attn*pairs``.

        Once a one-token step was observed, a group of one-token work only
        (decodes: ``tokens <= n`` and ``pairs == kv``) is priced by the decode
        anchor ``step' + per_request' * n (+ first) + (per_kv + per_attn) * kv``
        instead, and any other group by the larger of the two (so one more
        query token never makes a group cheaper: predictions stay monotone).
        """
        c = self._coef
        t = c[0] + c[1] * totals[0] + c[2] * totals[1] + c[3] * totals[2] + c[4] * totals[3]
        d = self._dec_coef
        if d is None:
            return t
        a = d[0] + d[1] * totals[0] + d[2] + (c[3] + c[4]) * totals[2]
        if totals[1] <= totals[0] and totals[3] == totals[2]:
            return a
        return t if t >= a else a

    def note_issued(self, batch: BatchWork) -> None:
        """The runtime issued ``batch``: the next batch priced runs right after it.

        The anchor's ``first`` term prices the first one-token step after a
        step with a chunk. With more than one batch in flight (async
        scheduling, stream pipelining) a batch is priced before the one issued
        ahead of it is observed, so once this is called pricing follows the
        last batch issued, while learning (:meth:`observe`) keeps following
        the steps observed. An empty batch changes nothing.
        """
        x = self._slowest_group(batch)
        if x is None:
            return
        since = 1 if _one_token_work(x) else 0
        if since != self._issued_since:
            self._issued_since = since
            self._sync_decode()

    def frozen(self) -> OnlineCostModel:
        """A copy that later observations of this model do not change."""
        return OnlineCostModel.from_state(self.state())

    # -------------------------------------------------------------- learning
    def observe(self, batch: BatchWork, seconds: float) -> float | None:
        """Learn from one executed batch that took ``seconds``.

        Returns the relative error ``|predicted - seconds| / seconds`` of the
        prediction made before this update (None, and nothing learned, for an
        empty batch or a time that is not a positive finite number).
        """
        if not _finite_number(seconds) or seconds <= 0:
            return None
        x = self._slowest_group(batch)
        if x is None:
            return None
        theta = self._theta
        shared = sum(t * f for t, f in zip(theta, x, strict=True))
        decode = _one_token_work(x)
        predicted = shared
        if self._dec is not None:
            anchor = self._decode_time(x)
            predicted = anchor if decode else max(shared, anchor)
        error = abs(predicted - seconds) / seconds
        self.errors.append(error)
        # residual relative to the prediction: weights that do not depend on the
        # measurement keep the fit unbiased for the mean time (relative to the
        # measurement, slow steps would count less and the fit would run low)
        ref = max(shared, 1e-9)
        # A one-token step the decode anchor priced is judged for drift by the
        # anchor's price, not the shared fit's: the shared fit prices them far
        # off (its ``step`` holds the chunks' fixed cost: 3-5 ms for about
        # 0.8 ms steps in the issue-18 hog runs), so each run of three was a
        # drift that rescaled the shared coefficients to the one-token level
        # (16x down), the next chunk was priced 20x-50x low, its drift scaled
        # them back, and the two kinds of steps took turns (the p90 after the
        # hog was 40-97% in replays of those runs).
        anchored = seconds / max(predicted, 1e-9) if decode and self._dec is not None else None
        self._update([f / ref for f in x], seconds / ref, _step_class(x), anchored)
        after = 1 if decode else 0
        if decode:
            self._learn_decode(x, seconds)
            self._dec_idle = 0
        else:
            self._dec_idle += 1
        if after != self._dec_since:
            self._dec_since = after
            self._sync_decode()
        return error

    def _decode_features(self, x: Sequence[float]) -> tuple[float, ...]:
        """The decode anchor's features of a group with features ``x`` (units of
        ``_UNITS``): ``(1, requests, first)``, ``first`` 1 on the first step
        after a step with a chunk (in the issue-18 budget runs the first
        one-token step after a chunk ran 1.3-1.5x the later ones: caches the
        chunk evicted). The KV terms stay the shared fit's (:meth:`_decode_kv`):
        the short chats' one-token steps hardly excite them (a per-KV term
        learned from them alone ran away)."""
        return (1.0, x[1], 1.0 if self._dec_since == 0 else 0.0)

    def _decode_kv(self, x: Sequence[float]) -> float:
        """The shared fit's KV terms as for one-token work (one pair per KV entry read)."""
        t = self._theta
        return (t[3] + t[4] / _UNITS[2]) * x[3]

    def _decode_time(self, x: Sequence[float]) -> float:
        d = self._dec
        assert d is not None
        fixed = sum(a * v for a, v in zip(d, self._decode_features(x), strict=True))
        return fixed + self._decode_kv(x)

    def _learn_decode(self, x: Sequence[float], seconds: float) -> None:
        """One RLS step of the decode anchor on a step of one-token work that took
        ``seconds`` (``x``: its features in units of ``_UNITS``).

        The shared fit is dominated by the chunk steps around these: a chunk
        mispredicted at long KV moves ``step`` and the one-token steps after
        it were predicted up to 2x off (1.3-1.9 ms for about 1.05 ms in the
        budget runs), and space sharing then left the long prompt's chunk out
        or took it back. The anchor learns from one-token steps alone (its
        own RLS on the relative residual, forgetting ``_DEC_FORGET``); it
        starts from the shared fit's terms for one-token work scaled to the
        first one-token step and relearns around fresh covariance after
        ``_DEC_GAP`` steps without one.
        """
        if self._dec is None:
            # the shared fit's terms for one-token work, their level set by this
            # first step (the shared fit priced it up to 6x off in loaded runs)
            t = self._theta
            d = [t[0], t[1] + t[2] / _UNITS[2], 0.0]
            fixed = d[0] + d[1] * x[1]
            kv = self._decode_kv(x)
            want = max(seconds - kv, 0.1 * seconds)
            factor = min(max(want / max(fixed, 1e-12), 1 / 16), 16.0)
            self._dec = [d[0] * factor, d[1] * factor, 0.0]
            self._dec[0] = max(self._dec[0], _MIN_STEP)
            self._reset_decode_covariance()
            self._sync_decode()
            return
        if self._dec_idle > _DEC_GAP:
            self._reset_decode_covariance()
        d = self._dec
        f = self._decode_features(x)
        fixed = sum(a * v for a, v in zip(d, f, strict=True))
        predicted = max(fixed + self._decode_kv(x), 1e-9)
        log_r = math.log(seconds / predicted)
        a = abs(log_r)
        weight = 1.0
        if a > max(self.reject * self._scale, _DEC_CLIP):
            # far off: pauses (a loaded machine descheduled one or two steps in a
            # row for 5-9 ms) are ignored; ``drift_steps`` in a row of one sign
            # are a change, learned from around fresh covariance by their median
            # log ratio, at most 2x at a time
            far = self._dec_out
            far = [*far, log_r] if far and (far[0] > 0) == (log_r > 0) else [log_r]
            if len(far) < self.drift_steps:
                self._dec_out = far
                return
            self._dec_out = []
            self._reset_decode_covariance()
            med = statistics.median(far)
            log_r = math.copysign(min(abs(med), _DEC_CLIP), med)
        else:
            self._dec_out = []
            if a > self.huber * self._scale:
                weight = self.huber * self._scale / a
        residual = math.exp(log_r) - 1.0
        x_rel = [v / predicted for v in f]
        p, lam = self._dec_p, _DEC_FORGET
        n = len(d)
        px = [sum(p[i][j] * x_rel[j] for j in range(n)) for i in range(n)]
        denom = lam / weight + sum(x_rel[i] * px[i] for i in range(n))
        if not (math.isfinite(denom) and denom > 0):
            self._reset_decode_covariance()
            return
        gain = [v / denom for v in px]
        raw = [a + g * residual for a, g in zip(d, gain, strict=True)]
        moved = sum(r * v for r, v in zip(raw, f, strict=True)) - fixed
        if min(raw) < 0 or moved * residual < 0:
            # The step would drive a coefficient below 0 (the fit then trades the
            # clamped term for another, and the anchor ran away upward under 1 ms
            # steps in a loaded run) or move this step's price the wrong way:
            # scale the whole anchor toward the measurement instead.
            factor = math.exp(0.5 * log_r * min(weight, 1.0))  # halfway, as a log
            self._dec = [min(max(a * factor, 0.0), _MAX_COEF) for a in d]
            self._dec[0] = max(self._dec[0], _MIN_STEP)
            self._sync_decode()
            return
        new = [min(v, _MAX_COEF) for v in raw]
        new[0] = max(new[0], _MIN_STEP)
        new_p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        trace = sum(new_p[i][i] for i in range(n))
        if not all(math.isfinite(v) for v in new) or not math.isfinite(trace) or trace <= 0:
            self._reset_decode_covariance()
            return
        limit = self._decode_covariance_cap(new)
        if trace > limit:  # no wind-up in directions the data does not excite
            new_p = [[v * limit / trace for v in row] for row in new_p]
        self._dec, self._dec_p = new, new_p
        self._sync_decode()

    def _reset_decode_covariance(self) -> None:
        """A diagonal covariance around the anchor, ``_DEC_PRIOR`` times looser
        than the shared fit's (``first`` and ``second`` as if 0.3 ``step``)."""
        d = self._dec
        assert d is not None
        diag = self._decode_prior(d)
        n = len(diag)
        self._dec_p = [[diag[i] if i == j else 0.0 for j in range(n)] for i in range(n)]

    def _decode_prior(self, d: Sequence[float]) -> list[float]:
        floors = (0.1 * max(d), 0.1 * max(d), 0.3 * d[0])
        loose = _DEC_PRIOR / self.prior_strength
        return [max(v, f) ** 2 * loose for v, f in zip(d, floors, strict=True)]

    def _decode_covariance_cap(self, d: Sequence[float]) -> float:
        """The anchor's covariance trace is held to 10x its prior's around ``d``."""
        return 10.0 * sum(self._decode_prior(d))

    def _sync_decode(self) -> None:
        """What ``group_time`` reads of the anchor; the fixed cost cap holds it too."""
        d = self._dec
        if d is None:
            self._dec_coef = None
            self._check_revision()
            return
        cap = self.fixed_cost_cap
        fixed = d[0] + d[1] + d[2]
        if cap is not None and fixed > cap:
            shrink = cap / fixed
            d[0] = max(d[0] * shrink, _MIN_STEP)
            d[1], d[2] = d[1] * shrink, d[2] * shrink
        since = self._dec_since if self._issued_since is None else self._issued_since
        self._dec_coef = (d[0], d[1], d[2] if since == 0 else 0.0)
        self._check_revision()

    @property
    def median_error(self) -> float | None:
        """Median relative error of the last (up to) 100 observed steps."""
        return statistics.median(self.errors) if self.errors else None

    def _slowest_group(self, batch: BatchWork) -> list[float] | None:
        """``[1, *totals]`` in units of ``_UNITS`` of the group predicted slowest."""
        best: list[float] | None = None
        best_time = -1.0
        for items in batch.groups:
            if not items:
                continue
            totals = [0, 0, 0, 0]
            for w in items:
                for i, f in enumerate(self.features(w.q_tokens, w.kv_tokens, w.tail)):
                    totals[i] += f
            t = self.group_time(totals)
            if t > best_time:
                best_time = t
                best = [1.0] + [tot / u for tot, u in zip(totals, _UNITS[1:], strict=True)]
        return best

    def _update(
        self, x: list[float], ratio: float, kind: int, anchored: float | None = None
    ) -> None:
        """One weighted RLS step on ``1 ~ theta . x`` with robust weighting.

        ``x`` are the features over the prediction, ``ratio`` measured over
        predicted, ``kind`` the step's class (:func:`_step_class`). Outliers
        and drift are judged on the log ratio, which is symmetric: a step
        predicted 20x too high (relative residual -0.95) is as far off as
        one predicted 20x too low (+19). ``anchored``: for a one-token step
        the decode anchor priced, measured over the anchor's price; the
        overall drift streak judges it by that, and it ends its class's
        streak. A streak of such steps alone rescales the anchor, not the
        shared fit (:meth:`_rescale_anchor`); a mixed streak it completes
        rescales the shared fit, which takes no step on it. Otherwise it
        learns from it as usual (robustly, ignored when the shared fit
        prices it far off).
        """
        log_r = math.log(ratio)
        residual = ratio - 1.0
        a = abs(log_r)
        big = a > self.huber * self._scale
        sign = 1 if log_r > 0 else -1
        streak_log = log_r if anchored is None else math.log(anchored)
        if abs(streak_log) > self.huber * self._scale:
            streak_sign = 1 if streak_log > 0 else -1
            if self._streak * streak_sign > 0:
                self._streak += streak_sign
                self._streak_residuals.append(streak_log)
                self._streak_anchored += anchored is not None
            else:
                self._streak, self._streak_residuals = streak_sign, [streak_log]
                self._streak_anchored = int(anchored is not None)
        else:
            self._streak, self._streak_residuals, self._streak_anchored = 0, [], 0
        # the same per class of step: interleaved steps of another kind that
        # are predicted well must not hide a class that is persistently off
        count, logs = self._class_streaks.get(kind, (0, ()))
        if big and anchored is None:
            count, logs = (count + sign, (*logs, log_r)) if count * sign > 0 else (sign, (log_r,))
        else:
            count, logs = 0, ()
        # the anchor prices it: no class drift of the shared fit (its class's streak ends)
        self._class_streaks[kind] = (count, logs[-self.drift_steps :])
        weight = 1.0
        if abs(self._streak) >= self.drift_steps and self._streak_anchored == abs(self._streak):
            # Only one-token steps, each off the anchor's price: the anchor's level
            # changed (a hog slowing them, not the chunks); rescale the anchor
            # alone, so the chunks keep the shared fit's price.
            self._rescale_anchor(statistics.median(self._streak_residuals))
            return
        if abs(self._streak) >= self.drift_steps:
            # A change of regime, not an outlier. Most are a uniform speed
            # change (cores taken or freed): rescale by the streak's median
            # measured/predicted ratio, then relearn around it.
            med = statistics.median(self._streak_residuals)
            factor = math.exp(min(max(med, -_MAX_DRIFT_LOG), _MAX_DRIFT_LOG))
            self._theta = [min(t * factor, _MAX_COEF) for t in self._theta]
            self._sync()
            if self._dec is not None:  # it relearns from the next one-token steps
                self._reset_decode_covariance()
            x = [f / factor for f in x]
            residual = ratio / factor - 1.0
            self.drifts += 1
            self._streak, self._streak_residuals, self._streak_anchored = 0, [], 0
            self._class_streaks.clear()
            self._reset_covariance()
            if anchored is not None:
                return  # the shared fit's price of it is no measure of the change
        elif abs(count) >= self.drift_steps:
            # One class of steps is persistently off while others are not (a
            # CPU hog slows one-token steps far more than long chunks): what
            # repeats is no outlier. Relearn from it (its streak's median
            # ratio, so one wild member does not set the size) at full weight
            # around fresh covariance; the gain goes to the terms that
            # dominate this class.
            residual = math.exp(statistics.median(logs)) - 1.0
            self.drifts += 1
            self._class_streaks[kind] = (0, ())
            self._reset_covariance()
        elif a > self.reject * self._scale:
            return  # a lone outlier: ignored (counted in the streaks only)
        elif big:
            weight = self.huber * self._scale / a
        # the scale measures noise around each class's own recent level, not
        # how far a class is off: a class predicted 10x too high must not
        # inflate the scale until its residuals look ordinary
        center = self._class_centers.get(kind, 0.0)
        spread = abs(log_r - center)
        limit = self.reject * self._scale
        self._class_centers[kind] = center + 0.25 * (min(max(log_r, -limit), limit) - center)
        self._scale = 0.97 * self._scale + 0.03 * min(spread, self.huber * self._scale)
        self._scale = min(max(self._scale, 0.01), 1.0)
        self._rls(x, residual, weight)
        self.steps += 1

    def _rescale_anchor(self, log_ratio: float) -> None:
        """A drift of the decode anchor alone: its coefficients times the streak's
        median measured/predicted ratio (``log_ratio``, as a log, at most 16x),
        relearned around fresh covariance; the shared fit is left as it is."""
        assert self._dec is not None
        self._dec_out = []
        self._scale_decode(math.exp(min(max(log_ratio, -_MAX_DRIFT_LOG), _MAX_DRIFT_LOG)))
        self.drifts += 1
        self._streak, self._streak_residuals, self._streak_anchored = 0, [], 0

    def _rls(self, x: list[float], residual: float, weight: float) -> None:
        n = len(x)
        p, lam = self._p, self.forget
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam / weight + sum(x[i] * px[i] for i in range(n))
        if not (math.isfinite(denom) and denom > 0):
            return
        gain = [v / denom for v in px]
        theta = [t + g * residual for t, g in zip(self._theta, gain, strict=True)]
        theta = [min(max(t, 0.0), _MAX_COEF) for t in theta]
        theta[0] = max(theta[0], _MIN_STEP)
        new_p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        trace = sum(new_p[i][i] for i in range(n))
        if not all(math.isfinite(t) for t in theta) or not math.isfinite(trace) or trace <= 0:
            self._reset_covariance()
            return
        if trace > self._p_cap:  # no wind-up in directions the data does not excite
            shrink = self._p_cap / trace
            new_p = [[v * shrink for v in row] for row in new_p]
        self._theta, self._p = theta, new_p
        self._sync()

    def _reset_covariance(self) -> None:
        """A diagonal covariance around the current coefficients."""
        floor = 0.1 * max(self._theta)
        diag = [max(t, floor) ** 2 / self.prior_strength for t in self._theta]
        n = len(diag)
        self._p = [[diag[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._p_cap = 10.0 * sum(diag)

    def _sync(self) -> None:
        cap = self.fixed_cost_cap
        if cap is not None and self._theta[0] + self._theta[1] > cap:
            shrink = cap / (self._theta[0] + self._theta[1])
            self._theta[0] = max(self._theta[0] * shrink, _MIN_STEP)
            self._theta[1] *= shrink
        self._coef = tuple(t / u for t, u in zip(self._theta, _UNITS, strict=True))
        self._check_revision()

    def _check_revision(self) -> None:
        """Bump ``revision`` if some probe's predicted time moved past
        :data:`REVISION_THRESHOLD`: the decode probe's by the shared fit, the
        prompt probes' by :meth:`group_time`, where the decode anchor sets a
        floor (tables of prefill times hold it). The anchor's ``first`` term
        is left out: it flips with every step that has a chunk (one step's
        price, not a table's)."""
        theta = self._theta
        times = [sum(t * f for t, f in zip(theta, _PROBES[0], strict=True))]
        coef = self._dec_coef
        if coef is not None:
            self._dec_coef = (coef[0], coef[1], 0.0)
        for p in _PROBES[1:]:
            times.append(self.group_time([v * u for v, u in zip(p[1:], _UNITS[1:], strict=True)]))
        self._dec_coef = coef
        old = self._revision_times
        times = tuple(times)
        if not old:
            self._revision_times = times
        elif any(abs(n - o) > REVISION_THRESHOLD * o for n, o in zip(times, old, strict=True)):
            self._revision_times = times
            self.revision += 1

    def rescale(self, factor: float) -> None:
        """Multiply every coefficient by ``factor`` (> 0) and relearn around them."""
        if not (_finite_number(factor) and factor > 0):
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        self._theta = [min(max(t * factor, 0.0), _MAX_COEF) for t in self._theta]
        self._theta[0] = max(self._theta[0], _MIN_STEP)
        self._sync()
        self._reset_covariance()
        self._scale_decode(factor)

    def _scale_decode(self, factor: float) -> None:
        """:meth:`rescale` moves the decode anchor too (around fresh covariance)."""
        if self._dec is not None:
            self._dec = [min(max(a * factor, 0.0), _MAX_COEF) for a in self._dec]
            self._dec[0] = max(self._dec[0], _MIN_STEP)
            self._reset_decode_covariance()
            self._sync_decode()

    def cap_fixed_cost(self, seconds: float | None) -> None:
        """Set :attr:`fixed_cost_cap` and apply it now."""
        if seconds is not None and not (_finite_number(seconds) and seconds > 0):
            raise ValueError(f"fixed cost cap must be a positive number, got {seconds!r}")
        self.fixed_cost_cap = seconds
        self._sync()
        self._sync_decode()

    # ------------------------------------------------------------ construction
    @classmethod
    def from_model(
        cls, prior: CostModel, *, layout: ParallelDegrees | None = None, **kw: float
    ) -> OnlineCostModel:
        """Start from another model: an affine one maps exactly; any other is
        fitted to its predictions over a spread of prefill and decode batches."""
        from medha_sched.cost.affine import AffineCostModel

        layout = prior.layout if layout is None else layout
        if isinstance(prior, OnlineCostModel):
            return cls(tuple(prior._coef), layout=layout, **kw)  # type: ignore[arg-type]
        if isinstance(prior, AffineCostModel):
            coef = (prior.base, 0.0, prior.per_token, 0.0, prior.per_attn)
            return cls(coef, layout=layout, **kw)  # type: ignore[arg-type]
        return _fit_to(prior, layout, kw)

    @classmethod
    def from_spec(
        cls, params: Mapping[str, str], *, layout: ParallelDegrees = DEFAULT_LAYOUT
    ) -> OnlineCostModel:
        """``online:FILE`` (saved state) or ``online:prior=SPEC`` (start from a model,
        e.g. ``online:prior=table:profile.json``)."""
        check_spec_keys("online", params, optional=("path", "prior"))
        if ("path" in params) == ("prior" in params):
            raise ValueError(
                "cost model 'online' needs a saved state (online:FILE) or a prior "
                "(online:prior=table:PROFILE.json); the server's bare 'online' starts "
                "from its start-up calibration"
            )
        if "prior" in params:
            return cls.from_model(parse_cost_model_spec(params["prior"], layout=layout))
        model = cls.load(params["path"])
        if model.layout != layout:
            model.layout = layout
        return model

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        """Everything needed to resume learning (JSON-serialisable)."""
        lay = self.layout
        return {
            "kind": _KIND,
            "version": _VERSION,
            "layout": {"tp": lay.tp, "spp": lay.spp, "kvp": lay.kvp},
            "coefficients": self.coefficients,
            "settings": {
                "forget": self.forget,
                "prior_strength": self.prior_strength,
                "huber": self.huber,
                "reject": self.reject,
                "drift_steps": self.drift_steps,
            },
            "covariance": [list(row) for row in self._p],
            "covariance_cap": self._p_cap,
            "robust_scale": self._scale,
            "drift": self._drift_state(),
            "decode": None
            if self._dec is None
            else {
                "coefficients": list(self._dec),
                "covariance": [list(row) for row in self._dec_p],
                "since_chunk": self._dec_since,
                "chunks_since": self._dec_idle,
                "far_off": list(self._dec_out),
            },
            "steps": self.steps,
            "drifts": self.drifts,
            "median_error": self.median_error,
        }

    @classmethod
    def from_state(cls, state: Mapping) -> OnlineCostModel:
        """Rebuild a model from :meth:`state`; a bad state is a ``ValueError`` naming the field."""
        if not isinstance(state, Mapping) or state.get("kind") != _KIND:
            raise ValueError(f"not an online cost model state (want kind={_KIND!r})")
        if state.get("version") not in (1, _VERSION):
            raise ValueError(
                f"online cost model state version {state.get('version')!r}; "
                f"this Medha reads versions 1 to {_VERSION}"
            )
        try:
            coef = state["coefficients"]
            coefficients = [float(coef[name]) for name in COEFFICIENTS]
            layout = ParallelDegrees(**{k: int(v) for k, v in state["layout"].items()})
            settings = dict(state.get("settings", {}))
            model = cls(coefficients, layout=layout, **settings)
            cov = state.get("covariance")
            if cov is not None:
                n = len(COEFFICIENTS)
                p = [[float(v) for v in row] for row in cov]
                if len(p) != n or any(len(row) != n for row in p):
                    raise ValueError(f"covariance must be {n} x {n}")
                if not all(math.isfinite(v) for row in p for v in row):
                    raise ValueError("covariance has a non-finite entry")
                model._p = p
                cap = float(state.get("covariance_cap", model._p_cap))
                if not (math.isfinite(cap) and cap > 0):
                    raise ValueError(f"covariance_cap must be > 0, got {cap!r}")
                model._p_cap = cap
            scale = float(state.get("robust_scale", model._scale))
            if not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"robust_scale must be > 0, got {scale!r}")
            model._scale = scale
            if state.get("drift") is not None:
                try:
                    model._load_drift(state["drift"])
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"bad drift state: {exc}") from None
            if state.get("decode") is not None:
                try:
                    model._load_decode(state["decode"])
                except (ValueError, TypeError, KeyError) as exc:
                    raise ValueError(f"bad decode state: {exc}") from None
            model.steps = int(state.get("steps", 0))
            model.drifts = int(state.get("drifts", 0))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"online cost model state: missing or bad field {exc}") from None
        return model

    def _drift_state(self) -> dict:
        """The robust fit's short memory: the open streaks (overall and per
        class of step), each class's recent level, and the last errors. A
        model resumed from it judges its next steps as the saved one would."""
        return {
            "streak": self._streak,
            "streak_log_ratios": list(self._streak_residuals),
            "streak_anchored": self._streak_anchored,
            "classes": [
                [kind, count, list(logs), self._class_centers.get(kind)]
                for kind, (count, logs) in sorted(self._class_streaks.items())
            ]
            + [
                [kind, 0, [], center]
                for kind, center in sorted(self._class_centers.items())
                if kind not in self._class_streaks
            ],
            "errors": list(self.errors),
        }

    def _load_drift(self, drift: Mapping) -> None:
        """Restore :meth:`_drift_state`; a bad entry is a ``ValueError`` naming it."""
        if not isinstance(drift, Mapping):
            raise ValueError(f"want an object, got {drift!r}")
        streak = drift.get("streak", 0)
        logs = [float(v) for v in drift.get("streak_log_ratios", [])]
        if not isinstance(streak, int) or abs(streak) != len(logs):
            raise ValueError(f"streak {streak!r} does not match its {len(logs)} log ratios")
        anchored = drift.get("streak_anchored", 0)  # absent before 2026-11-26 noon: 0
        if not isinstance(anchored, int) or not 0 <= anchored <= len(logs):
            raise ValueError(f"streak_anchored {anchored!r}: want 0 to {len(logs)}")
        streaks: dict[int, tuple[int, tuple[float, ...]]] = {}
        centers: dict[int, float] = {}
        for entry in drift.get("classes", []):
            if not isinstance(entry, list | tuple) or len(entry) != 4:
                raise ValueError(
                    f"a classes entry must be [kind, count, logs, center], got {entry!r}"
                )
            kind, count, class_logs, center = entry
            if not isinstance(kind, int) or not isinstance(count, int):
                raise ValueError(f"classes entry {entry!r}: kind and count must be integers")
            streaks[kind] = (count, tuple(float(v) for v in class_logs)[-self.drift_steps :])
            if center is not None:
                centers[kind] = float(center)
        errors = [float(v) for v in drift.get("errors", [])]
        values = [*logs, *centers.values(), *errors]
        for logs_ in streaks.values():
            values.extend(logs_[1])
        if not all(math.isfinite(v) for v in values) or any(e < 0 for e in errors):
            raise ValueError("a non-finite log ratio or a negative error")
        self._streak, self._streak_residuals, self._streak_anchored = streak, logs, anchored
        self._class_streaks, self._class_centers = streaks, centers
        self.errors.clear()
        self.errors.extend(errors[-_ERROR_WINDOW:])

    def _load_decode(self, dec: Mapping) -> None:
        """Restore the decode anchor of :meth:`state`; a bad entry is a ``ValueError``."""
        if not isinstance(dec, Mapping):
            raise ValueError(f"want an object, got {dec!r}")
        coef = [float(v) for v in dec["coefficients"]]
        cov = [[float(v) for v in row] for row in dec["covariance"]]
        n = 3
        if len(coef) != n or len(cov) != n or any(len(row) != n for row in cov):
            raise ValueError(f"want {n} coefficients and a {n} x {n} covariance")
        if not all(math.isfinite(v) and v >= 0 for v in coef):
            raise ValueError(f"coefficients must be finite and >= 0, got {coef!r}")
        if not all(math.isfinite(v) for row in cov for v in row):
            raise ValueError("covariance has a non-finite entry")
        since, idle = dec.get("since_chunk", 1), dec.get("chunks_since", 0)
        out = [float(v) for v in dec.get("far_off", [])]
        if not (since in (0, 1) and isinstance(idle, int) and idle >= 0):
            raise ValueError(f"since_chunk {since!r} / chunks_since {idle!r}")
        if len(out) >= self.drift_steps or not all(math.isfinite(v) for v in out):
            raise ValueError(f"far_off must be fewer than drift_steps finite log ratios: {out!r}")
        coef[0] = max(coef[0], _MIN_STEP)
        self._dec = coef
        self._dec_p = cov
        self._dec_since, self._dec_idle, self._dec_out = since, idle, out
        self._sync_decode()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`state` as JSON (atomically: a temporary file, then a rename)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.state(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> OnlineCostModel:
        """Read a file :meth:`save` wrote; errors name the file."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read online cost model {path!r}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path!r} is not JSON: {exc}") from None
        try:
            return cls.from_state(state)
        except ValueError as exc:
            raise ValueError(f"{path!r}: {exc}") from None

    def __repr__(self) -> str:
        coef = ", ".join(f"{k}={v:.3g}" for k, v in self.coefficients.items())
        return f"OnlineCostModel({coef}, steps={self.steps}, layout={self.layout})"


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _one_token_work(x: Sequence[float]) -> bool:
    """Whether features ``x`` (units of ``_UNITS``) are a group of one-token work
    only (decodes): no more tail tokens than requests, and as many attended
    pairs as KV entries read (exact: the units are powers of two)."""
    return x[2] * _UNITS[2] <= x[1] and x[4] * _UNITS[2] == x[3]


def _step_class(x: Sequence[float]) -> int:
    """The class of a step, from its features in units of ``_UNITS``: the
    slowest group's query tokens in factors of 4 (1-3 tokens, 4-15, ...)."""
    tokens = round(x[2] * _UNITS[2])
    return min(tokens.bit_length() // 2, _CLASSES - 1)


def _fit_to(prior: CostModel, layout: ParallelDegrees, kw: Mapping[str, float]) -> OnlineCostModel:
    """Fit the online form to ``prior``'s predictions (a profile table, a roofline)."""
    batches = []
    for q in (32, 128, 512, 2048):
        for kv in (0, 2048, 8192, 32768):
            batches.append(BatchWork.single_group((q, kv)))
    for n in (1, 8, 32):
        for kv in (256, 4096, 32768):
            batches.append(BatchWork.single_group(*[(1, kv)] * n))
    timed = [(b, prior.predict(b)) for b in batches]
    timed = [(b, t) for b, t in timed if _finite_number(t) and t > 0]
    if not timed:
        raise ValueError(f"prior cost model {prior!r} predicts no positive times")
    step = min(t for _, t in timed)
    model = OnlineCostModel((step, 0.0, 0.0, 0.0, 0.0), layout=layout, prior_strength=1e-3)
    for _ in range(20):  # plain RLS passes (no robust weights: the prior is noise-free)
        for b, t in timed:
            x = model._slowest_group(b)
            assert x is not None
            pred = sum(a * f for a, f in zip(model._theta, x, strict=True))
            model._rls([f / t for f in x], 1.0 - pred / t, 1.0)
    return OnlineCostModel(tuple(model._coef), layout=layout, **kw)  # type: ignore[arg-type]


__all__ = ["COEFFICIENTS", "OnlineCostModel"]
