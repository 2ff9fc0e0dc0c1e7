"""A cost model that interpolates a measured profile stored as JSON.

Per KVP group::

    time = base_s + linear(sum of tail query tokens)
                  + sum over requests of (per_request_s + attention(q_tokens, kv_attended))

with ``kv_attended = kv_tokens + q_tokens`` on a request's tail group and
``kv_tokens`` elsewhere (as in the affine model). The profile is the latency
of one iteration through the whole replica of the recorded layout.

Schema (version 1)::

    {
      "version": 1,
      "layout": {"tp": 1, "spp": 1, "kvp": 1},      # optional, default all 1
      "base_s": 0.004,                              # > 0, once per group
      "per_request_s": 0.0008,                      # >= 0, optional (default 0)
      "linear": {"tokens": [1, 64, ...],            # >= 1, increasing
                 "seconds": [0.0001, 0.003, ...]},  # >= 0, non-decreasing
      "attention": {"q_tokens": [1, 64, ...],       # >= 1, increasing
                    "kv_tokens": [0, 1024, ...],    # kv attended, >= 0, increasing
                    "seconds": [[...], ...]},       # [len(q_tokens)][len(kv_tokens)]
      "meta": {...}                                 # optional, ignored
    }

Every axis has at least two points. Seconds are finite, >= 0 and
non-decreasing along every axis. ``linear(0) = 0``.

Evaluation: piecewise-linear between grid points (bilinear for attention);
flat below the first point; beyond the last point, extended with the slope
of the last segment. For attention beyond the last ``kv_tokens`` the
per-row slopes are raised to a running maximum over ``q_tokens``, so the
extension stays non-decreasing in both arguments and never negative. A
request with more query tokens than the last ``q_tokens`` (``Q``) is priced
as the query tiles a tiled attention kernel runs: a first piece of
``r = q - (k - 1) * Q`` tokens, then ``k - 1`` pieces of ``Q``, each attending
to the KV before it plus itself on a tail group (``kv + r``, ``kv + r + Q``,
...) and to the same ``kv`` elsewhere. Monotone up to floating-point
rounding.

:meth:`TableCostModel.fit` builds a table from measured samples; see there.
"""

from __future__ import annotations

import json
import math
import reprlib
import statistics
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from os import PathLike
from pathlib import Path
from typing import Any, ClassVar

from medha_sched.config import ParallelDegrees
from medha_sched.cost.base import AggregateCostModel, BatchWork
from medha_sched.cost.registry import DEFAULT_LAYOUT, check_spec_keys

SCHEMA_VERSION = 1
_TOP_KEYS = ("version", "layout", "base_s", "per_request_s", "linear", "attention", "meta")
_REQUIRED_KEYS = ("version", "base_s", "linear", "attention")
_Floats = tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class TableCostModel(AggregateCostModel):
    """Interpolated profile: ``base_s + linear(tail tokens) + sum (per_request_s + attention)``.

    Attributes mirror the JSON schema in the module docstring; ``source``
    names the profile in error messages.
    """

    base_s: float
    linear_tokens: _Floats
    linear_seconds: _Floats
    attention_q: _Floats
    attention_kv: _Floats
    attention_seconds: tuple[_Floats, ...]
    layout: ParallelDegrees = field(default_factory=ParallelDegrees)
    per_request_s: float = 0.0
    source: str = field(default="table", compare=False)
    _lin_slopes: _Floats = field(init=False, repr=False, compare=False)
    _row_slopes: tuple[_Floats, ...] = field(init=False, repr=False, compare=False)
    _row_end: _Floats = field(init=False, repr=False, compare=False)
    _q_inv: _Floats = field(init=False, repr=False, compare=False)

    #: features: (tail query tokens, summed attention seconds)
    num_features: ClassVar[int] = 2

    def __post_init__(self) -> None:
        src, put = self.source, object.__setattr__
        put(self, "base_s", _positive(src, "base_s", self.base_s))
        put(self, "per_request_s", _non_negative(src, "per_request_s", self.per_request_s))
        put(self, "linear_tokens", _axis(src, "linear.tokens", self.linear_tokens, minimum=1))
        n = len(self.linear_tokens)
        put(self, "linear_seconds", _seconds(src, "linear.seconds", self.linear_seconds, n))
        put(self, "attention_q", _axis(src, "attention.q_tokens", self.attention_q, minimum=1))
        put(self, "attention_kv", _axis(src, "attention.kv_tokens", self.attention_kv, minimum=0))
        grid = _grid(src, self.attention_seconds, self.attention_q, self.attention_kv)
        put(self, "attention_seconds", grid)
        if not isinstance(self.layout, ParallelDegrees):
            raise ValueError(f"{src}: layout must be a ParallelDegrees, got {self.layout!r}")
        self._precompute()

    def _precompute(self) -> None:
        put = object.__setattr__
        qs, xs, rows = self.attention_q, self.attention_kv, self.attention_seconds
        put(self, "_lin_slopes", _slopes(self.linear_tokens, self.linear_seconds))
        row_slopes = tuple(_slopes(xs, row) for row in rows)
        put(self, "_row_slopes", row_slopes)
        put(self, "_row_end", tuple(accumulate((s[-1] for s in row_slopes), max)))
        put(self, "_q_inv", tuple(1.0 / (b - a) for a, b in pairwise(qs)))

    # ------------------------------------------------------------------ hot path
    def features(self, q_tokens: int, kv_tokens: int, tail: bool) -> tuple[float, ...]:
        """``(tail query tokens, per-request plus attention seconds)`` of one request."""
        if tail:
            return (
                q_tokens,
                self.per_request_s + self.attention_time(q_tokens, kv_tokens + q_tokens),
            )
        return (0, self.per_request_s + self.attention_time(q_tokens, kv_tokens, causal=False))

    def group_time(self, totals: Sequence[float]) -> float:
        """``base_s + linear(totals[0]) + totals[1]``."""
        q = totals[0]
        return self.base_s + (self.linear_time(q) if q > 0 else 0.0) + totals[1]

    def linear_time(self, tokens: float) -> float:
        """Interpolated linear-layer seconds for ``tokens`` tail query tokens."""
        xs, slopes = self.linear_tokens, self._lin_slopes
        j = bisect_right(xs, tokens) - 1
        return _pwl(xs, self.linear_seconds, slopes, slopes[-1], tokens, j)

    def attention_time(self, q_tokens: float, kv_attended: float, *, causal: bool = True) -> float:
        """Interpolated attention seconds of one request; beyond the last
        ``q_tokens``, the sum over query tiles (``causal``: the request's tail
        group, whose tiles see the KV before them; otherwise every tile sees
        ``kv_attended``)."""
        xs, qs = self.attention_kv, self.attention_q
        if q_tokens > qs[-1]:
            return self._tiled(q_tokens, kv_attended, causal)
        j = bisect_right(xs, kv_attended) - 1
        i = bisect_right(qs, q_tokens) - 1
        if i < 0:
            return self._row(0, kv_attended, j)
        last = len(qs) - 1
        if i >= last:
            return self._row(last, kv_attended, j)
        a, b = self._row(i, kv_attended, j), self._row(i + 1, kv_attended, j)
        if b <= a:
            return a
        return min(a + (q_tokens - qs[i]) * self._q_inv[i] * (b - a), b)

    def _tiled(self, q: float, kv_attended: float, causal: bool) -> float:
        xs, last = self.attention_kv, len(self.attention_q) - 1
        big = self.attention_q[last]
        pieces = math.ceil(q / big)
        first = q - (pieces - 1) * big
        if not causal:
            rest = (pieces - 1) * self._row(last, kv_attended, bisect_right(xs, kv_attended) - 1)
            return self.attention_time(first, kv_attended) + rest
        seen = max(kv_attended - q, 0.0) + first
        total = self.attention_time(first, seen)
        j = 0
        for _ in range(pieces - 1):  # full tiles: the last row, at a growing KV
            seen += big
            j = bisect_right(xs, seen, j) - 1
            total += self._row(last, seen, j)
            j = max(j, 0)
        return total

    def _row(self, i: int, x: float, j: int) -> float:
        xs = self.attention_kv
        return _pwl(xs, self.attention_seconds[i], self._row_slopes[i], self._row_end[i], x, j)

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_json(
        cls, path: str | PathLike[str], *, layout: ParallelDegrees | None = None
    ) -> TableCostModel:
        """Load a profile; ``layout``, if given, must match the file's."""
        src = f"table file {str(path)!r}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read {src}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{src} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, layout=layout, source=src)

    @classmethod
    def from_dict(
        cls, data: object, *, layout: ParallelDegrees | None = None, source: str = "table"
    ) -> TableCostModel:
        """Build from a decoded JSON object (see the schema)."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: top level must be a JSON object, got {_short(data)}")
        _check_keys(source, "", data, required=_REQUIRED_KEYS, allowed=_TOP_KEYS)
        version = data["version"]
        if type(version) is not int or version != SCHEMA_VERSION:
            raise ValueError(f"{source}: field 'version' must be {SCHEMA_VERSION}, got {version!r}")
        found = _layout(source, data.get("layout", {}))
        if layout is not None and layout != found:
            raise ValueError(f"{source} was measured for {found}, not the requested {layout}")
        lin = _section(source, data, "linear", ("tokens", "seconds"))
        att = _section(source, data, "attention", ("q_tokens", "kv_tokens", "seconds"))
        return cls(
            base_s=data["base_s"],
            linear_tokens=lin["tokens"],
            linear_seconds=lin["seconds"],
            attention_q=att["q_tokens"],
            attention_kv=att["kv_tokens"],
            attention_seconds=att["seconds"],
            layout=found,
            per_request_s=data.get("per_request_s", 0.0),
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """The profile as a JSON-ready object (schema version 1)."""
        lay = self.layout
        return {
            "version": SCHEMA_VERSION,
            "layout": {"tp": lay.tp, "spp": lay.spp, "kvp": lay.kvp},
            "base_s": self.base_s,
            "per_request_s": self.per_request_s,
            "linear": {"tokens": _ints(self.linear_tokens), "seconds": list(self.linear_seconds)},
            "attention": {
                "q_tokens": _ints(self.attention_q),
                "kv_tokens": _ints(self.attention_kv),
                "seconds": [list(row) for row in self.attention_seconds],
            },
        }

    def to_json(self, path: str | PathLike[str]) -> None:
        """Write the profile to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_spec(
        cls, params: Mapping[str, str], *, layout: ParallelDegrees = DEFAULT_LAYOUT
    ) -> TableCostModel:
        """Build from ``table:PATH`` (or ``table:path=PATH``)."""
        check_spec_keys("table", params, required=("path",))
        return cls.from_json(params["path"], layout=layout)

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(
        cls,
        samples: Iterable[tuple[BatchWork, float]],
        *,
        layout: ParallelDegrees = DEFAULT_LAYOUT,
        base_s: float | None = None,
        per_request_s: float | None = None,
    ) -> TableCostModel:
        """Build a table from measured ``(batch, seconds)`` samples.

        Two kinds of batch are understood, each on a single KVP group with
        tail items only:

        * *single-request* batches ``(q, kv)``, which must cover a full grid
          of at least two ``q`` and two ``kv`` values;
        * *decode* batches of ``n >= 2`` requests with ``q = 1`` and equal
          ``kv`` (optional), which add linear points at ``n`` tokens.

        For each ``q`` the single-request times are taken as linear in
        ``kv_attended`` near the smallest ``kv``: the line through the two
        smallest ``kv`` is extended to ``kv_attended = 0``, and its intercept
        ``I(q)`` is ``base_s + linear(q) + per_request_s``. The rest is
        attention, resampled onto the union of every ``kv`` and ``kv + q``
        (through ``attention(q, 0) = 0``) and made non-decreasing by running
        maxima. A decode batch of ``n`` gives
        ``D(n) = seconds - n * attention(1, kv + 1) = base_s + linear(n) + n * per_request_s``,
        so ``per_request_s`` defaults to the median of ``(D(n) - I(n)) / (n - 1)``
        over the decode batches whose ``n`` lies within the sampled ``q``
        (``I`` interpolated; 0 without decode batches, never negative, and at
        most half the smallest ``q``'s intercept, which holds a positive base
        too).
        ``base_s`` defaults to the linear points' line extended to 0 tokens.
        Repeated samples are averaged. Exact for affine timings.
        """
        singles, decodes = _split_samples(samples)
        qs, xs, rows, intercepts = _fit_attention(singles)
        probe = cls(
            base_s=1.0,
            linear_tokens=(1, 2),
            linear_seconds=(0, 0),
            attention_q=qs,
            attention_kv=xs,
            attention_seconds=rows,
            source="fit",
        )
        spent = {
            key: _mean(secs) - key[0] * probe.attention_time(1, key[1] + 1)
            for key, secs in decodes.items()
        }
        if per_request_s is None:
            per_request_s = _fit_per_request(intercepts, spent)
        points = {q: [c - per_request_s] for q, c in intercepts.items()}
        for (n, _), d in spent.items():
            points.setdefault(n, []).append(d - n * per_request_s)
        tokens = sorted(points)
        totals = [_mean(points[t]) for t in tokens]
        base = _fit_base(tokens, totals) if base_s is None else base_s
        lin = tuple(accumulate((max(c - base, 0.0) for c in totals), max))
        return cls(
            base_s=base,
            linear_tokens=tokens,
            linear_seconds=lin,
            attention_q=qs,
            attention_kv=xs,
            attention_seconds=rows,
            layout=layout,
            per_request_s=per_request_s,
            source="fitted table",
        )


# ---------------------------------------------------------------------- evaluation
def _pwl(xs: _Floats, ys: _Floats, slopes: _Floats, end: float, x: float, j: int) -> float:
    """Piecewise-linear ``ys(x)``; ``j = bisect_right(xs, x) - 1``."""
    if j < 0:
        return ys[0]
    if j >= len(xs) - 1:
        return ys[-1] + (x - xs[-1]) * end
    return min(ys[j] + (x - xs[j]) * slopes[j], ys[j + 1])


def _slopes(xs: _Floats, ys: _Floats) -> _Floats:
    pairs = zip(pairwise(xs), pairwise(ys), strict=True)
    return tuple((y1 - y0) / (x1 - x0) for (x0, x1), (y0, y1) in pairs)


# ---------------------------------------------------------------------- validation
def _short(value: object) -> str:
    return reprlib.repr(value)


def _number(src: str, name: str, value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"{src}: field {name!r} must hold finite numbers, got {_short(value)}")
    return float(value)  # type: ignore[arg-type]


def _numbers(src: str, name: str, values: object) -> _Floats:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{src}: field {name!r} must be a list of numbers, got {_short(values)}")
    return tuple(_number(src, name, v) for v in values)


def _positive(src: str, name: str, value: object) -> float:
    number = _number(src, name, value)
    if number <= 0:
        raise ValueError(f"{src}: field {name!r} must be > 0, got {value!r}")
    return number


def _non_negative(src: str, name: str, value: object) -> float:
    number = _number(src, name, value)
    if number < 0:
        raise ValueError(f"{src}: field {name!r} must be >= 0, got {value!r}")
    return number


def _axis(src: str, name: str, values: object, *, minimum: float) -> _Floats:
    axis = _numbers(src, name, values)
    if len(axis) < 2:
        raise ValueError(f"{src}: field {name!r} needs at least 2 points, got {_short(values)}")
    if axis[0] < minimum:
        raise ValueError(f"{src}: field {name!r} must be >= {minimum}, got {axis[0]!r}")
    if any(b <= a for a, b in pairwise(axis)):
        raise ValueError(f"{src}: field {name!r} must be strictly increasing, got {_short(values)}")
    return axis


def _seconds(src: str, name: str, values: object, length: int) -> _Floats:
    secs = _numbers(src, name, values)
    if len(secs) != length:
        raise ValueError(f"{src}: field {name!r} has {len(secs)} values, its axis has {length}")
    if secs[0] < 0:
        raise ValueError(f"{src}: field {name!r} must be >= 0, got {secs[0]!r}")
    if any(b < a for a, b in pairwise(secs)):
        raise ValueError(f"{src}: field {name!r} must be non-decreasing, got {_short(values)}")
    return secs


def _grid(src: str, values: object, qs: _Floats, xs: _Floats) -> tuple[_Floats, ...]:
    name = "attention.seconds"
    if not isinstance(values, (list, tuple)) or len(values) != len(qs):
        raise ValueError(f"{src}: field {name!r} must be {len(qs)} rows, got {_short(values)}")
    rows = tuple(_seconds(src, f"{name}[{i}]", row, len(xs)) for i, row in enumerate(values))
    for i, (lo, hi) in enumerate(pairwise(rows)):
        if any(b < a for a, b in zip(lo, hi, strict=True)):
            raise ValueError(f"{src}: field {name!r} must be non-decreasing in q; row {i + 1}")
    return rows


def _check_keys(
    src: str, where: str, data: dict, *, required: Sequence[str], allowed: Sequence[str]
) -> None:
    for key in data:
        if key not in allowed:
            raise ValueError(f"{src}: unknown field {where + str(key)!r}; known: {list(allowed)}")
    for key in required:
        if key not in data:
            raise ValueError(f"{src}: missing field {where + key!r}")


def _section(src: str, data: dict, name: str, keys: Sequence[str]) -> dict:
    section = data[name]
    if not isinstance(section, dict):
        raise ValueError(f"{src}: field {name!r} must be an object, got {_short(section)}")
    _check_keys(src, name + ".", section, required=keys, allowed=keys)
    return section


def _layout(src: str, value: object) -> ParallelDegrees:
    if not isinstance(value, dict):
        raise ValueError(f"{src}: field 'layout' must be an object, got {_short(value)}")
    keys = ("tp", "spp", "kvp")
    _check_keys(src, "layout.", value, required=(), allowed=keys)
    try:
        return ParallelDegrees(**value)
    except ValueError as exc:
        raise ValueError(f"{src}: field 'layout': {exc}") from exc


def _ints(values: _Floats) -> list[float]:
    return [int(v) if v.is_integer() else v for v in values]


# ---------------------------------------------------------------------- fitting
def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _split_samples(
    samples: Iterable[tuple[BatchWork, float]],
) -> tuple[dict[tuple[int, int], list[float]], dict[tuple[int, int], list[float]]]:
    """Sort samples into single-request and decode batches, by (tokens, kv)."""
    singles: dict[tuple[int, int], list[float]] = {}
    decodes: dict[tuple[int, int], list[float]] = {}
    for idx, sample in enumerate(samples):
        batch, seconds = _unpack_sample(idx, sample)
        items = [g for g in batch.groups if g]
        if len(items) != 1 or not all(w.tail for w in items[0]):
            raise ValueError(f"fit: sample {idx} must be one KVP group of tail items, got {batch}")
        works = items[0]
        if len(works) == 1:
            singles.setdefault((works[0].q_tokens, works[0].kv_tokens), []).append(seconds)
        elif all(w.q_tokens == 1 and w.kv_tokens == works[0].kv_tokens for w in works):
            decodes.setdefault((len(works), works[0].kv_tokens), []).append(seconds)
        else:
            raise ValueError(
                f"fit: sample {idx} is neither a single request nor a decode batch "
                f"(q=1, equal kv): {batch}"
            )
    return singles, decodes


def _unpack_sample(idx: int, sample: object) -> tuple[BatchWork, float]:
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ValueError(f"fit: sample {idx} must be a (BatchWork, seconds) pair, got {sample!r}")
    batch, seconds = sample
    if not isinstance(batch, BatchWork):
        raise ValueError(f"fit: sample {idx} has no BatchWork, got {batch!r}")
    return batch, _positive("fit", f"sample {idx} seconds", seconds)


def _fit_attention(
    singles: dict[tuple[int, int], list[float]],
) -> tuple[list[int], list[int], list[list[float]], dict[int, float]]:
    """Attention grid and per-``q`` intercepts (``base_s + linear(q)``)."""
    qs, kvs = sorted({q for q, _ in singles}), sorted({kv for _, kv in singles})
    if len(qs) < 2 or len(kvs) < 2:
        raise ValueError(
            f"fit needs single-request samples at >= 2 q_tokens and >= 2 kv_tokens, "
            f"got q_tokens={qs}, kv_tokens={kvs}"
        )
    xs = sorted(set(kvs) | {kv + q for q in qs for kv in kvs})
    rows, intercepts = [], {}
    for q in qs:
        ys = []
        for kv in kvs:
            if (q, kv) not in singles:
                raise ValueError(f"fit: no single-request sample at q_tokens={q}, kv_tokens={kv}")
            ys.append(_mean(singles[(q, kv)]))
        px = [kv + q for kv in kvs]
        slope = max((ys[1] - ys[0]) / (px[1] - px[0]), 0.0)
        intercepts[q] = ys[0] - slope * px[0]
        py = [0.0] + [max(y - intercepts[q], 0.0) for y in ys]
        rows.append(list(accumulate((_extrapolate([0, *px], py, x) for x in xs), max)))
    for i in range(1, len(rows)):
        rows[i] = [max(a, b) for a, b in zip(rows[i - 1], rows[i], strict=True)]
    return qs, xs, rows, intercepts


def _fit_per_request(intercepts: dict[int, float], spent: dict[tuple[int, int], float]) -> float:
    """Median of ``(D(n) - I(n)) / (n - 1)`` (see ``TableCostModel.fit``), at least 0."""
    qs = sorted(intercepts)
    ys = [intercepts[q] for q in qs]
    estimates = [
        (d - _extrapolate(qs, ys, n)) / (n - 1)
        for (n, _), d in spent.items()
        if qs[0] <= n <= qs[-1]
    ]
    if not estimates:
        return 0.0
    median = statistics.median(estimates)
    # the smallest request's intercept holds one per-request cost and a positive base
    return min(max(median, 0.0), 0.5 * max(ys[0], 0.0))


def _extrapolate(px: Sequence[float], py: Sequence[float], x: float) -> float:
    """Linear through ``(px, py)``, extended by the end segments."""
    j = min(max(bisect_right(px, x) - 1, 0), len(px) - 2)
    return py[j] + (x - px[j]) * (py[j + 1] - py[j]) / (px[j + 1] - px[j])


def _fit_base(tokens: Sequence[int], totals: Sequence[float]) -> float:
    """The first linear segment extended to 0 tokens, at most the first point;
    the first point itself when that line crosses 0 (noisy timings)."""
    (t0, t1), (c0, c1) = tokens[:2], totals[:2]
    base = min(c0 - (c1 - c0) / (t1 - t0) * t0, c0)
    if not base > 0:
        base = c0
    if not base > 0:  # only with per_request_s given larger than the timings allow
        raise ValueError(f"fit: estimated base_s={base!r} is not > 0; pass base_s explicitly")
    return base
