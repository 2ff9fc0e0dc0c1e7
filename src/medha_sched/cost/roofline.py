"""An analytic roofline cost model from a model shape and a GPU spec.

Each operation takes ``max(FLOPs / achievable FLOP/s, bytes / achievable
HBM bytes/s)``. Per layer and per KVP group the operations are:

* QKV projection, output projection and the SwiGLU MLP (three matmuls) on
  the group's *tail* query tokens; each reads its weights once per iteration
  (sharded by ``tp``) plus its input and output activations. A group holding
  any request reads its weights, even if it only attends.
* Attention: ``4 * pairs * (h_q / tp) * d`` FLOPs, where a tail item attends
  to its ``kv`` cached tokens and causally to itself (``q*kv + q(q+1)/2``
  pairs) and a non-tail item attends to its shard (``q*kv`` pairs); bytes are
  the group's KV shard read once per request (plus the chunk's new KV
  written) and the queries read and outputs written.
* KVP merge: a non-tail item sends its partial output ``[q, h_q/tp, d]`` in
  bf16 and its fp32 log-sum-exp ``[q, h_q/tp]`` over the interconnect.
* TP (``tp > 1``): two ring all-reduces of the tail activations,
  ``2 (tp-1)/tp * q * hidden * 2`` bytes each, plus a fixed launch cost.
* A fixed ``kernel_overhead`` for each of ``KERNELS_PER_LAYER`` kernels.

The output head runs once per iteration on one token per tail request (the
sampled position). Stream pipelining splits the layers over ``spp`` stages;
the latency through all stages is the sum of the stage times (all layers)
plus ``spp - 1`` sends of ``q * hidden * 2`` activation bytes.

Activations and KV are bf16 (2 bytes); weights use ``bytes_per_param``. All
traffic (TP, SPP, KVP) uses the intra-node interconnect rate, unscaled.

Approximation: to stay additive, requests contribute summed features
(tail tokens, attended pairs, KV tokens read, query tokens, merged tokens,
tail requests) and the ``max`` of compute and memory is taken per operation
over the whole group, as if one batched kernel served all its requests.
This is optimistic for batches that mix very different requests (a real
kernel may be memory-bound on some and compute-bound on others) but keeps
the model monotone and O(1) per request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from typing import ClassVar

from medha_sched.chunking import _GUESSES, largest_chunk_priced
from medha_sched.config import ParallelDegrees
from medha_sched.cost.base import AggregateCostModel
from medha_sched.cost.hardware import HardwareSpec, get_hardware
from medha_sched.cost.models import ModelShape, get_model_shape
from medha_sched.cost.registry import DEFAULT_LAYOUT, check_spec_keys

#: fixed-cost kernels per layer (norms, projections, rope, attention, MLP)
KERNELS_PER_LAYER = 8

_ACT_BYTES = 2  # bf16 activations and KV
_LSE_BYTES = 4  # fp32 log-sum-exp
_INF = float("inf")


@dataclass(frozen=True, kw_only=True, slots=True)
class RooflineCostModel(AggregateCostModel):
    """Roofline time of ``model`` on ``hardware`` in ``layout``.

    Features per request: (tail query tokens, attended pairs, KV tokens read
    or written, query tokens, merged query tokens, tail requests).
    """

    model: ModelShape
    hardware: HardwareSpec
    layout: ParallelDegrees = field(default_factory=ParallelDegrees)
    _layer: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _outer: tuple[float, ...] = field(init=False, repr=False, compare=False)

    num_features: ClassVar[int] = 6
    affine_decode_features: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelShape):
            raise ValueError(f"model must be a ModelShape, got {self.model!r}")
        if not isinstance(self.hardware, HardwareSpec):
            raise ValueError(f"hardware must be a HardwareSpec, got {self.hardware!r}")
        if not isinstance(self.layout, ParallelDegrees):
            raise ValueError(f"layout must be a ParallelDegrees, got {self.layout!r}")
        layer = _layer_coef(self.model, self.hardware, self.layout.tp)
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(self, "_outer", _outer_coef(self.model, self.hardware, self.layout))

    def features(self, q_tokens: int, kv_tokens: int, tail: bool) -> tuple[float, ...]:
        """Additive features of one request on one group."""
        if tail:
            pairs = q_tokens * kv_tokens + q_tokens * (q_tokens + 1) // 2
            return (q_tokens, pairs, kv_tokens + q_tokens, q_tokens, 0, 1)
        return (0, q_tokens * kv_tokens, kv_tokens, q_tokens, q_tokens, 0)

    def group_time(self, totals: Sequence[float]) -> float:
        """Seconds of one group through every stage, from summed features."""
        q, pairs, kv, qa, qm, nt = totals
        (c_qkv, w_qkv, a_qkv, c_att, b_kv, b_qo, c_o, w_o, a_o, c_m, w_m, a_m) = self._layer
        (merge, fixed, ar_fixed, ar_tok, layers, c_h, w_h, a_h, pp_fixed, pp_tok) = self._outer
        # Each term is max(compute, memory); written as conditionals (the hot path).
        a, b = q * c_qkv, w_qkv + q * a_qkv
        layer = a if a > b else b
        a, b = pairs * c_att, kv * b_kv + qa * b_qo
        layer += a if a > b else b
        a, b = q * c_o, w_o + q * a_o
        layer += a if a > b else b
        a, b = q * c_m, w_m + q * a_m
        layer += a if a > b else b
        layer = layer + qm * merge + fixed  # the same order of additions as before
        if q > 0:
            layer += ar_fixed + q * ar_tok
        time = layers * layer + pp_fixed + qa * pp_tok
        if nt > 0:
            a, b = nt * c_h, w_h + nt * a_h
            time += a if a > b else b
        return time

    def group_time_varying(
        self, totals: Sequence[float], i: int, j: int
    ) -> Callable[[float, float], float] | None:
        """:meth:`group_time` as a function of the attended pairs and KV tokens
        (``i, j == 1, 2``; else None), the other totals fixed: the terms that
        do not move are computed once, and each call adds the same floats in
        the same order as :meth:`group_time`.

        The function's ``series`` attribute prices a whole decode run in one
        call (:meth:`DecodeLanes.one_group_times
        <medha_sched.decode_set.DecodeLanes.one_group_times>`'s loop, the
        function written out in it): ``series(ai, bi, ci, aj, bj, cj, kv_sum,
        nt, first, steps, budget)`` is the list of ``time_of(ai + kv * bi +
        ci, aj + kv * bj + cj)`` with ``kv = kv_sum + nt * step`` for ``step``
        from ``first`` on, ``steps`` of them or up to the first whose running
        sum reaches ``budget`` seconds (that one included)."""
        if (i, j) != (1, 2) or type(self).group_time is not RooflineCostModel.group_time:
            return None  # (a subclass that prices otherwise keeps group_time)
        q, _, _, qa, qm, nt = totals
        return _varying(self._layer, self._outer, q, qa, qm, nt)

    def chunk_price(self) -> Callable[[Sequence[float] | None, int, int], float] | None:
        """``price(base, start, n)``: :meth:`group_time` of ``base`` (None: nothing)
        plus the features of an ``n``-token tail chunk at KV position ``start``,
        summed term by term as ``base[k] + features(n, start, True)[k]``; the
        same floats. None for a subclass that prices otherwise."""
        if (
            type(self).group_time is not RooflineCostModel.group_time
            or type(self).features is not RooflineCostModel.features
        ):
            return None  # (a subclass that prices otherwise keeps the general path)
        return _chunk_price(self._layer, self._outer)

    @classmethod
    def from_spec(
        cls, params: Mapping[str, str], *, layout: ParallelDegrees = DEFAULT_LAYOUT
    ) -> RooflineCostModel:
        """Build from ``roofline:model=NAME,gpu=NAME`` parameters."""
        check_spec_keys("roofline", params, required=("model", "gpu"))
        shape = get_model_shape(params["model"])
        return cls(model=shape, hardware=get_hardware(params["gpu"]), layout=layout)


@lru_cache(maxsize=1024, typed=True)
def _varying(
    layer: tuple[float, ...], outer: tuple[float, ...], q: float, qa: float, qm: float, nt: float
) -> Callable[[float, float], float]:
    """:meth:`RooflineCostModel.group_time_varying` for these coefficients and
    fixed totals (kept: a lane's decode count recurs from run to run, some 15
    distinct sets of totals in 20,959 calls at 0.25 QPS; module level, like
    :func:`_chunk_price`, so the model stays picklable)."""
    (c_qkv, w_qkv, a_qkv, c_att, b_kv, b_qo, c_o, w_o, a_o, c_m, w_m, a_m) = layer
    (merge, fixed, ar_fixed, ar_tok, layers, c_h, w_h, a_h, pp_fixed, pp_tok) = outer
    a, b = q * c_qkv, w_qkv + q * a_qkv
    qkv = a if a > b else b
    read_q = qa * b_qo
    a, b = q * c_o, w_o + q * a_o
    out = a if a > b else b
    a, b = q * c_m, w_m + q * a_m
    mlp = a if a > b else b
    merged = qm * merge
    reduce = ar_fixed + q * ar_tok if q > 0 else None
    send = qa * pp_tok
    head = None
    if nt > 0:
        a, b = nt * c_h, w_h + nt * a_h
        head = a if a > b else b

    def time_of(pairs: float, kv: float) -> float:
        a, b = pairs * c_att, kv * b_kv + read_q
        layer = qkv + (a if a > b else b)
        layer += out
        layer += mlp
        layer = layer + merged + fixed
        if reduce is not None:
            layer += reduce
        time = layers * layer + pp_fixed + send
        if head is not None:
            time += head
        return time

    def series(
        ai: float,
        bi: float,
        ci: float,
        aj: float,
        bj: float,
        cj: float,
        kv_sum: int,
        nt: int,
        first: int,
        steps: int,
        budget: float,
    ) -> list[float]:
        if reduce is not None and head is not None and steps > 0:
            run = _memory_bound_run(ai, bi, ci, aj, bj, cj, kv_sum, nt, first, steps, bounds)
            if run is not None:  # the branch below fixed: the tokens as a range of ints
                return _memory_series(run, steps, budget, terms)
        times = []
        spent = 0.0
        for step in range(first, first + steps):
            kv = kv_sum + nt * step
            pairs, tokens = ai + kv * bi + ci, aj + kv * bj + cj
            # time_of(pairs, tokens)
            a, b = pairs * c_att, tokens * b_kv + read_q
            layer = qkv + (a if a > b else b)
            layer += out
            layer += mlp
            layer = layer + merged + fixed
            if reduce is not None:
                layer += reduce
            time = layers * layer + pp_fixed + send
            if head is not None:
                time += head
            times.append(time)
            spent += time
            if spent >= budget:
                break
        return times

    bounds = (c_att, b_kv, read_q)
    terms = (qkv, b_kv, read_q, out, mlp, merged, fixed, reduce, layers, pp_fixed, send, head)
    time_of.series = series  # type: ignore[attr-defined]
    return time_of


def _memory_bound_run(
    ai: float,
    bi: float,
    ci: float,
    aj: float,
    bj: float,
    cj: float,
    kv_sum: int,
    nt: int,
    first: int,
    steps: int,
    bounds: tuple[float, float, float],
) -> range | None:
    """The KV tokens of a decode run's steps as a ``range`` of ints, when the
    attention's memory branch wins (``not a > b`` in ``series``) at every
    step, proved; else None.

    With integer arguments the attended pairs and the KV tokens are exact
    ints, affine in the step, so the compute side ``pairs * c_att`` and the
    memory side ``tokens * b_kv + read_q`` are affine in reals. Checked at
    both ends with ``_SURE``'s margin (their floats err by a few unit
    roundoffs), the compute side stays below the memory side in between too,
    and so do their floats. Non-negative coefficients and totals only (the
    roofline's)."""
    for x in (ai, bi, ci, aj, bj, cj, kv_sum, nt, first):
        if type(x) is not int:
            return None
    c_att, b_kv, read_q = bounds
    if not (c_att >= 0.0 and b_kv >= 0.0 and read_q >= 0.0):
        return None
    ends = []
    for step in (first, first + steps - 1):
        kv = kv_sum + nt * step
        pairs, tokens = ai + kv * bi + ci, aj + kv * bj + cj
        if pairs < 0 or tokens < 0 or not pairs * c_att < (tokens * b_kv + read_q) * _SURE:
            return None
        ends.append(tokens)
    stride = nt * bj
    if stride <= 0:
        return None
    return range(ends[0], ends[1] + stride, stride)


def _memory_series(
    tokens: range, steps: int, budget: float, terms: tuple[float, ...]
) -> list[float]:
    """``series``' list where the memory branch wins at every step (see
    :func:`_memory_bound_run`): each time is ``time_of``'s floats in its
    order of additions (the comprehension is a copy of the loop's body,
    twin-tested in ``tests/sched/test_varying_series.py``), the running sum
    and its stop rule ``spent >= budget`` the loop's.

    With non-negative terms the times never fall as the tokens grow (every
    operation is monotone), so the run reaches ``budget`` within about
    ``budget / first time`` steps: only those are priced, the running sums
    taken by ``accumulate`` (the same additions in the same order; ``0.0 + t
    == t``) and the stop found by bisection (the sums never fall); should the
    bound fall short, the rest goes step by step."""
    if not all(0.0 <= x < _INF for x in terms):  # (inf * 0 layers: NaN sums, unsorted)
        return _memory_loop(tokens, 0.0, budget, [], terms)
    (qkv, b_kv, read_q, out, mlp, merged, fixed, reduce, layers, pp_fixed, send, head) = terms
    count = steps
    if budget < _INF:
        first = _memory_time(tokens[0], terms)
        bound = budget / (first * _SURE) if first > 0.0 else _INF
        if bound < steps:  # the sum of m times is at least m * first (less roundoff)
            count = int(bound) + 2 if bound > 0.0 else 1
    times = [
        layers * (qkv + (t * b_kv + read_q) + out + mlp + merged + fixed + reduce)
        + pp_fixed
        + send
        + head
        for t in tokens[:count]
    ]
    if not budget < _INF:  # never reached (a nan budget is never reached either)
        return times
    sums = list(accumulate(times))
    stop = bisect_left(sums, budget)  # the first sum reaching it
    if stop < len(sums):
        return times[: stop + 1]
    return _memory_loop(tokens[count:], sums[-1] if sums else 0.0, budget, times, terms)


def _memory_time(t: int, terms: tuple[float, ...]) -> float:
    """One step's time at ``t`` KV tokens where the memory branch wins:
    ``time_of``'s floats, in its order."""
    (qkv, b_kv, read_q, out, mlp, merged, fixed, reduce, layers, pp_fixed, send, head) = terms
    layer = qkv + (t * b_kv + read_q) + out + mlp + merged + fixed + reduce
    return layers * layer + pp_fixed + send + head


def _memory_loop(
    tokens: range, spent: float, budget: float, times: list[float], terms: tuple[float, ...]
) -> list[float]:
    """:func:`_memory_series` step by step from ``spent``, appending to ``times``."""
    for t in tokens:
        time = _memory_time(t, terms)
        times.append(time)
        spent += time
        if spent >= budget:
            break
    return times


def _layer_coef(m: ModelShape, hw: HardwareSpec, tp: int) -> tuple[float, ...]:
    """Per-layer matmul and attention coefficients (seconds per unit)."""
    flops, mem, b = hw.flops_rate, hw.memory_rate, m.bytes_per_param
    h, d = m.hidden_size, m.head_dim
    hq, hkv = m.num_q_heads / tp, max(m.num_kv_heads / tp, 1.0)
    qkv, out, mlp = m.qkv_params / tp, m.out_params / tp, m.mlp_params / tp
    qkv_width = (m.num_q_heads + 2 * m.num_kv_heads) * d / tp
    return (
        2 * qkv / flops,
        qkv * b / mem,
        _ACT_BYTES * (h + qkv_width) / mem,
        4 * hq * d / flops,
        2 * hkv * d * _ACT_BYTES / mem,
        2 * hq * d * _ACT_BYTES / mem,
        2 * out / flops,
        out * b / mem,
        _ACT_BYTES * (hq * d + h) / mem,
        2 * mlp / flops,
        mlp * b / mem,
        _ACT_BYTES * (2 * h + 3 * m.intermediate_size / tp) / mem,
    )


def _outer_coef(m: ModelShape, hw: HardwareSpec, layout: ParallelDegrees) -> tuple[float, ...]:
    """Merge, fixed, TP, output-head and SPP coefficients."""
    tp, spp, link = layout.tp, layout.spp, hw.interconnect_bandwidth
    hq, h = m.num_q_heads / tp, m.hidden_size
    ring = 2 * (tp - 1) / tp * h * _ACT_BYTES / link
    head = m.head_params / tp
    return (
        hq * (m.head_dim * _ACT_BYTES + _LSE_BYTES) / link,
        KERNELS_PER_LAYER * hw.kernel_overhead,
        2 * hw.kernel_overhead if tp > 1 else 0.0,
        2 * ring,
        float(m.num_layers),
        2 * head / hw.flops_rate,
        head * m.bytes_per_param / hw.memory_rate,
        _ACT_BYTES * (h + m.vocab_size / tp) / hw.memory_rate,
        (spp - 1) * hw.kernel_overhead,
        (spp - 1) * h * _ACT_BYTES / link,
    )


@lru_cache(maxsize=64)
def _chunk_price(
    layer: tuple[float, ...], outer: tuple[float, ...]
) -> Callable[[Sequence[float] | None, int, int], float]:
    """:meth:`RooflineCostModel.chunk_price` for these coefficients (built once
    per model shape, here rather than on the model: it stays picklable)."""
    (c_qkv, w_qkv, a_qkv, c_att, b_kv, b_qo, c_o, w_o, a_o, c_m, w_m, a_m) = layer
    (merge, fixed, ar_fixed, ar_tok, layers, c_h, w_h, a_h, pp_fixed, pp_tok) = outer

    def price(base: Sequence[float] | None, start: int, n: int) -> float:
        pairs = n * start + n * (n + 1) // 2
        kv = start + n
        if base is None:  # features(n, start, True) as they are
            q, qa, qm, nt = n, n, 0, 1
        else:  # base + features, term by term (BatchCost's and adaptive_alone's sums)
            b0, b1, b2, b3, b4, b5 = base
            q, pairs, kv, qa, qm, nt = b0 + n, b1 + pairs, b2 + kv, b3 + n, b4 + 0, b5 + 1
        # group_time's body, unchanged
        a, b = q * c_qkv, w_qkv + q * a_qkv
        layer = a if a > b else b
        a, b = pairs * c_att, kv * b_kv + qa * b_qo
        layer += a if a > b else b
        a, b = q * c_o, w_o + q * a_o
        layer += a if a > b else b
        a, b = q * c_m, w_m + q * a_m
        layer += a if a > b else b
        layer = layer + qm * merge + fixed
        if q > 0:
            layer += ar_fixed + q * ar_tok
        time = layers * layer + pp_fixed + qa * pp_tok
        if nt > 0:
            a, b = nt * c_h, w_h + nt * a_h
            time += a if a > b else b
        return time

    price.search = _chunk_search(price, layer, outer)  # type: ignore[attr-defined]
    price.fits_after = _fits_after(layer, outer)  # type: ignore[attr-defined]
    return price


_BY_Q_MAX = 1 << 16
"""Entries kept in a search's memo of the terms that move with the tail tokens alone."""


def _active(q: float, c: float, w: float, a: float) -> tuple[float, float]:
    """A term's value ``max(q * c, w + q * a)`` at ``q`` tokens (``price``'s float)
    and the slope of its active branch (``c`` or ``a``)."""
    x, y = q * c, w + q * a
    return (x, c) if x > y else (y, a)


_SURE = 1.0 - 1e-9
"""How much of a convexity bound :func:`_chunk_search` trusts (the floats of a
price err by some 40 unit roundoffs, about 4.4e-15 of it, all terms positive)."""

_LOOSE = 1.0 + 1e-9
"""The margin :func:`_fits_after` keeps over a growth bound (the floats of the
two prices it relates err by some 40 unit roundoffs each)."""


def _fits_after(
    layer: tuple[float, ...], outer: tuple[float, ...]
) -> Callable[[float, int, float], bool | None]:
    """``fits_after(time, n, target)``: whether ``price(base, 0, n)`` (an
    ``n``-token tail chunk at KV 0 added to a base of non-negative totals) is
    at most ``target``, where ``time`` is the base's own price
    (``group_time(base)``), told without pricing the chunk: True surely
    within, False surely over, None not told.

    Each term of ``group_time`` is a ``max`` of lines in a total (or of a line
    and the attended pairs) with non-negative coefficients, and ``max(a, b) +
    min(x, y) <= max(a + x, b + y) <= max(a, b) + max(x, y)``: the chunk adds
    ``n`` query, KV and tail query tokens, ``n (n + 1) / 2`` attended pairs
    and one tail, so a term grows by at most ``n`` times its larger slope and
    at least ``n`` times its smaller one (the attention by the larger or the
    smaller of its two branches' growth; the head, whose tail count goes from
    ``nt`` to ``nt + 1``, by at most ``max(c_h, w_h + a_h)`` and at least 0;
    the all-reduce by ``n`` times its slope, and at most its fixed part more,
    in case the base had no query token). So the chunk's price is within
    ``time`` plus those bounds on the growth, ``[lo, hi]``, in reals; in
    floats each price errs by some 40 unit roundoffs (all terms
    non-negative), far inside the ``1e-9`` kept (``_LOOSE``, ``_SURE``). The
    bounds are kept by ``n`` (grid chunks recur)."""
    (c_qkv, _, a_qkv, c_att, b_kv, b_qo, c_o, _, a_o, c_m, _, a_m) = layer
    (_, _, ar_fixed, ar_tok, layers, c_h, w_h, a_h, _, pp_tok) = outer  # (fixed terms stay)
    rise = max(c_qkv, a_qkv) + max(c_o, a_o) + max(c_m, a_m) + ar_tok  # a query token's
    least = min(c_qkv, a_qkv) + min(c_o, a_o) + min(c_m, a_m) + ar_tok
    head = max(c_h, w_h + a_h)  # one more tail
    grown: dict[int, tuple[float, float]] = {}

    def fits_after(time: float, n: int, target: float) -> bool | None:
        bounds = grown.get(n)
        if bounds is None:
            pairs, read = n * (n + 1) // 2 * c_att, n * (b_kv + b_qo)
            lo = layers * (n * least + min(pairs, read)) + n * pp_tok
            hi = layers * (n * rise + max(pairs, read) + ar_fixed) + n * pp_tok + head
            if len(grown) >= 256:
                grown.clear()
            bounds = grown[n] = (lo, hi)
        lo, hi = bounds
        if (time + hi) * _LOOSE <= target:
            return True
        if (time + lo) * _SURE > target:
            return False
        return None

    return fits_after


def _chunk_search(
    price: Callable[[Sequence[float] | None, int, int], float],
    layer: tuple[float, ...],
    outer: tuple[float, ...],
) -> Callable[[int, int, Sequence[float] | None, int, float, float, int], tuple[int, float]]:
    """``search(limit, grid, base, start, target, base_time, hint)``: what
    :func:`~medha_sched.chunking.largest_chunk_priced` answers with ``price``,
    the same ``(chunk, seconds)``, in fewer and cheaper probes.

    Every operation of ``price`` (products by non-negative coefficients, sums
    of non-negative terms, ``max``) is monotone in floats, so its time never
    falls as ``n`` grows and every search that only returns a candidate it
    saw fit, and proves the next one over the target, finds the same chunk
    and the same float. This one probes as ``largest_chunk_priced`` does,
    with ``price``'s body written out (a copy: twin-tested against ``price``
    in ``tests/sched/test_chunk_search.py``) and the terms that do not move
    with ``n`` computed once. And after a probe that fits, it proves the next
    candidate over the target without pricing it where it can: each of
    ``price``'s terms is a ``max`` of lines (or of a line and the attended
    pairs, convex in ``n``), so a term grows from ``n`` to ``n + g`` by at
    least its active branch's growth, and the time by their sum, ``delta``;
    when ``(t + delta) * _SURE`` is over the target, the float price of ``n +
    g`` is too. A base with a negative total (no roofline feature is) goes to
    ``largest_chunk_priced`` itself.

    The QKV, output and MLP terms and the all-reduce depend on the tail query
    tokens ``q`` (the base's plus the chunk's) alone: they are kept by ``q``
    (chunk sizes and lane sizes recur; at most ``_BY_Q_MAX`` entries, then
    the memo starts again), the same floats, added in ``price``'s order. A
    probe that fits returns at once when the next candidate was seen, or is
    proved, over the target (the bracket is closed).
    """
    (c_qkv, w_qkv, a_qkv, c_att, b_kv, b_qo, c_o, w_o, a_o, c_m, w_m, a_m) = layer
    (merge, fixed, ar_fixed, ar_tok, layers, c_h, w_h, a_h, pp_fixed, pp_tok) = outer
    att_mem = b_kv + b_qo  # the attention's memory branch grows by this a token
    # q (the tail query tokens) -> the terms of price that move with q alone
    by_q: dict[float, tuple[float, float, float, float, float]] = {}

    def _q_terms(q: float) -> tuple[float, float, float, float, float]:
        """The QKV, output and MLP terms, the all-reduce, and the growth a
        token of their active branches and the all-reduce (``rise``), at
        ``q`` tail query tokens: price's floats (memoised: a chunk's size
        and a lane's decode count recur)."""
        x_qkv, s_qkv = _active(q, c_qkv, w_qkv, a_qkv)
        x_o, s_o = _active(q, c_o, w_o, a_o)
        x_m, s_m = _active(q, c_m, w_m, a_m)
        slope = s_qkv + s_o + s_m
        terms = (x_qkv, x_o, x_m, ar_fixed + q * ar_tok, slope + ar_tok)
        if len(by_q) >= _BY_Q_MAX:
            by_q.clear()
        by_q[q] = terms
        return terms

    def search(
        limit: int,
        grid: int,
        base: Sequence[float] | None,
        start: int,
        target: float,
        base_time: float,
        hint: int,
    ) -> tuple[int, float]:
        if grid < 1:
            raise ValueError(f"grid must be >= 1, got {grid!r}")
        if limit <= 0:
            return 0, 0.0
        if base is None:  # price's features(n, start, True) as they are: zeros added
            b0 = b1 = b2 = b3 = 0
            merged, nt = 0 * merge, 1
        else:
            b0, b1, b2, b3, b4, b5 = base
            if not (b0 >= 0 and b1 >= 0 and b2 >= 0 and b3 >= 0 and b4 >= 0 and b5 >= 0):
                return largest_chunk_priced(
                    limit, grid, price, base, start, target, base_time, hint
                )
            merged, nt = (b4 + 0) * merge, b5 + 1
        a, b = nt * c_h, w_h + nt * a_h
        head = a if a > b else b  # (nt > 0)
        # largest_chunk_priced's search, price(base, start, n) written out
        count = -(-limit // grid)
        top = count - 1
        lo, hi = -1, count
        fit = 0.0  # the time of candidate lo
        if hint > 0:
            i = hint // grid - 1
            if i > top:
                i = top
            elif i < 0:
                i = 0
        else:
            i = top
        n0, t0 = 0, base_time
        guesses = 0
        while True:
            n = (i + 1) * grid
            if n > limit:
                n = limit
            # t = price(base, start, n), each term's growing branch's slope noted
            q = b0 + n
            terms = by_q.get(q)
            if terms is None:
                terms = _q_terms(q)
            x_qkv, x_o, x_m, ar, rise = terms
            pairs = b1 + (n * start + n * (n + 1) // 2)
            qa = b3 + n
            kv = b2 + (start + n)
            x, y = pairs * c_att, kv * b_kv + qa * b_qo
            if x > y:
                layer = x_qkv + x
                paired = True
            else:
                layer = x_qkv + y
                paired = False
            layer += x_o
            layer += x_m
            layer = layer + merged + fixed
            layer += ar
            t = layers * layer + pp_fixed + qa * pp_tok + head
            if t <= target:
                if i + 1 >= hi:  # the next candidate was seen over the target (or is none)
                    return n, t
                # the next candidate: over the target by convexity?
                g = (i + 2) * grid
                if g > limit:
                    g = limit
                g -= n
                # the attended pairs grow (paired), else the KV read and queries
                att = (g * start + (g * (2 * n + g + 1)) // 2) * c_att if paired else g * att_mem
                if (t + layers * (g * rise + att) + g * pp_tok) * _SURE > target:
                    return n, t
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

    return search
