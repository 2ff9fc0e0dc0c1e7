"""Tests for ``PrefillTimeCache``: C(L), remaining time, feasibility, build cost.

The reference for exactness is an independent re-simulation written here:
a request alone is chunked greedily (the largest grid chunk whose solo time
fits T, capped at the max chunk, never crossing a KVP shard; if none fits,
one grid chunk), and C at each chunk boundary is the sum of the chunk times.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha_sched import (
    AffineCostModel,
    BatchResult,
    BatchWork,
    ParallelDegrees,
    PrefillTimeCache,
    Request,
    RequestTooLongError,
    RequestWork,
    Scheduler,
    SchedulerConfig,
)

from .models import PolyCostModel, poly_models

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# ------------------------------------------------------------- reference model
def solo_time(model, start: int, n: int, group_limit: int) -> float:
    """Predicted time of an ``n``-token chunk at KV ``start``, the request alone.

    Full shards before the tail only attend (non-tail); the tail shard appends.
    Only used for ``start + n <= kvp * group_limit`` (lengths a request can have).
    """
    kvp = model.layout.kvp
    tail = start // group_limit
    assert tail < kvp
    groups: list[list[RequestWork]] = [[] for _ in range(kvp)]
    for i in range(tail):
        groups[i].append(RequestWork(n, group_limit, False))
    groups[tail].append(RequestWork(n, start - tail * group_limit, True))
    return model.predict(BatchWork(groups=tuple(tuple(g) for g in groups)))


@dataclass
class Simulation:
    bounds: list[int] = field(default_factory=lambda: [0])
    cum: list[float] = field(default_factory=lambda: [0.0])
    first_infeasible: float = math.inf


def simulate(model, target: float, grid: int, max_chunk: int, group_limit: int, upto: int):
    """Chunk a request alone up to ``upto`` tokens (ascending scan, not bisection)."""
    sim = Simulation()
    done, total = 0, 0.0
    while done < upto:
        limit = min(max_chunk, group_limit - done % group_limit)
        best = 0
        for c in [*range(grid, limit, grid), limit]:
            if solo_time(model, done, c, group_limit) > target:
                break
            best = c
        if best == 0:
            # The longest prompt that still fits ends with a shorter final piece.
            tail = max(
                (
                    q
                    for q in range(1, min(grid, limit))
                    if solo_time(model, done, q, group_limit) <= target
                ),
                default=0,
            )
            sim.first_infeasible = min(sim.first_infeasible, done + tail)
            best = min(grid, limit)
        total += solo_time(model, done, best, group_limit)
        done += best
        sim.bounds.append(done)
        sim.cum.append(total)
    return sim


@st.composite
def cache_setups(draw, *, max_initial: int = 1500, min_group_limit: int = 64):
    layout = ParallelDegrees(spp=draw(st.integers(1, 3)), kvp=draw(st.integers(1, 3)))
    model = draw(poly_models(layout))
    grid = draw(st.sampled_from([1, 4, 16, 32, 64]))
    max_chunk = grid * draw(st.integers(1, 32))
    group_limit = draw(st.integers(max(grid, min_group_limit), 3000))
    if draw(st.booleans()):
        target = draw(st.floats(1e-3, 0.1))
    else:  # just above the smallest chunk's time: chunks shrink, and may stop fitting
        smallest = solo_time(model, 0, min(grid, max_chunk, group_limit), group_limit)
        target = max(1e-5, smallest + draw(st.floats(-5e-5, 3e-4)))
    initial = draw(st.integers(0, max_initial))
    cache = PrefillTimeCache(
        model,
        target_time=target,
        token_grid=grid,
        max_chunk_tokens=max_chunk,
        group_token_limit=group_limit,
        initial_tokens=initial,
    )
    return cache, model, target, grid, max_chunk, group_limit


# ------------------------------------------------------------------ properties
@SETTINGS
@given(setup=cache_setups(), data=st.data())
def test_c_matches_independent_simulation_at_and_between_boundaries(setup, data) -> None:
    cache, model, target, grid, max_chunk, group_limit = setup
    upto = min(1500, model.layout.kvp * group_limit)
    sim = simulate(model, target, grid, max_chunk, group_limit, upto)
    assert cache.prefill_time(0) == 0.0
    real = [(b, c) for b, c in zip(sim.bounds, sim.cum, strict=True) if b <= upto]
    for b, c in real:
        assert close(cache.prefill_time(b), c), f"C({b}) = {cache.prefill_time(b)} != {c}"
    # Between boundaries: C(b_k) plus one last, shorter chunk at KV b_k.
    for (b, c), (b_next, _) in itertools.pairwise(real):
        if b_next - b > 1:
            length = data.draw(st.integers(b + 1, b_next - 1))
            expected = c + solo_time(model, b, length - b, group_limit)
            assert close(cache.prefill_time(length), expected), length
    # max_feasible_tokens: the first boundary where no grid chunk fits T alone,
    # plus the longest shorter final piece that still fits there.
    if sim.first_infeasible < math.inf:
        assert cache.max_feasible_tokens == sim.first_infeasible
    else:
        assert cache.max_feasible_tokens >= sim.bounds[-1]


@SETTINGS
@given(setup=cache_setups(), data=st.data())
def test_c_is_zero_at_zero_and_non_decreasing(setup, data) -> None:
    cache, model, target, grid, max_chunk, group_limit = setup
    assert cache.prefill_time(0) == 0.0
    top = 3 * max(cache.built_tokens, 100)
    sample = sorted(data.draw(st.lists(st.integers(0, top), min_size=1, max_size=40)))
    values = [cache.prefill_time(n) for n in sample]
    assert all(v >= 0 for v in values)
    assert all(a <= b for a, b in itertools.pairwise(values)), list(
        zip(sample, values, strict=True)
    )
    # Consecutive lengths around the simulated boundaries (and shard edges).
    sim = simulate(model, target, grid, max_chunk, group_limit, min(600, group_limit))
    edges = {b + d for b in sim.bounds for d in (-1, 0, 1)} | {group_limit + d for d in (-1, 0, 1)}
    pts = sorted(e for e in edges if e >= 0)
    vals = [cache.prefill_time(n) for n in pts]
    assert all(a <= b for a, b in itertools.pairwise(vals)), list(zip(pts, vals, strict=True))


@SETTINGS
@given(setup=cache_setups(), data=st.data())
def test_remaining_time_properties(setup, data) -> None:
    cache, model, target, *_ = setup
    s = model.layout.spp
    top = max(cache.built_tokens, 50) * 2
    p = data.draw(st.integers(0, top))
    done = data.draw(st.integers(0, top))
    rem = cache.remaining_time(p, done)
    assert rem >= 0
    if done >= p:
        assert rem == 0.0
    else:
        expected = (cache.prefill_time(p) - cache.prefill_time(done)) / s + (1 - 1 / s) * target
        assert close(rem, expected)
    # non-decreasing in P for fixed done
    ps = sorted(data.draw(st.lists(st.integers(0, top), min_size=2, max_size=20)))
    by_p = [cache.remaining_time(x, done) for x in ps]
    assert all(a <= b + 1e-15 for a, b in itertools.pairwise(by_p)), list(
        zip(ps, by_p, strict=True)
    )
    # non-increasing in done for fixed P
    ds = sorted(data.draw(st.lists(st.integers(0, top), min_size=2, max_size=20)))
    by_done = [cache.remaining_time(p, x) for x in ds]
    assert all(a >= b - 1e-15 for a, b in itertools.pairwise(by_done)), list(
        zip(ds, by_done, strict=True)
    )
    assert cache.remaining_time(p, p) == 0.0
    assert cache.remaining_time(p, p + 17) == 0.0


@SETTINGS
@given(setup=cache_setups(), length=st.integers(1, 5000))
def test_spp_remaining_from_zero_adds_pipeline_fill(setup, length) -> None:
    cache, model, target, *_ = setup
    s = model.layout.spp
    expected = cache.prefill_time(length) / s + (1 - 1 / s) * target
    assert close(cache.remaining_time(length, 0), expected)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Large shards here: past kvp*G the cache folds extra shards onto the groups,
# and a chunk there is priced over every shard, so tiny G would be slow.
@given(setup=cache_setups(max_initial=300, min_group_limit=1000), data=st.data())
def test_lookups_far_beyond_the_table_extend_it_consistently(setup, data) -> None:
    cache, model, target, grid, max_chunk, group_limit = setup
    far = 10 * max(cache.built_tokens, 64) + 7
    before = [cache.prefill_time(n) for n in range(0, cache.built_tokens + 1, 7)]
    value = cache.prefill_time(far)  # no KeyError, no other exception
    assert cache.built_tokens >= far
    assert value >= cache.prefill_time(far - 1)
    assert cache.remaining_time(far + 3, far // 2) >= 0
    # Extending changes nothing already known...
    after = [cache.prefill_time(n) for n in range(0, len(before) * 7, 7)]
    assert before == after
    # ...and agrees exactly with a table built that long from the start.
    assert cache.built_tokens >= far + 3
    fresh = PrefillTimeCache(
        model,
        target_time=target,
        token_grid=grid,
        max_chunk_tokens=max_chunk,
        group_token_limit=group_limit,
        initial_tokens=cache.built_tokens,
    )
    sample = sorted(data.draw(st.lists(st.integers(0, far), min_size=1, max_size=30)))
    ours = [cache.prefill_time(n) for n in sample]
    assert ours == [fresh.prefill_time(n) for n in sample]
    assert all(a <= b for a, b in itertools.pairwise(ours))
    assert cache.max_feasible_tokens == fresh.max_feasible_tokens


def small_cache(**kw) -> PrefillTimeCache:
    model = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=0.0)
    args = dict(target_time=0.05, token_grid=32, max_chunk_tokens=2048, group_token_limit=1 << 20)
    args.update(kw)
    return PrefillTimeCache(model, **args)


@pytest.mark.parametrize("bad", [-1, -7, -12345])
def test_negative_lengths_raise_value_error_naming_the_value(bad: int) -> None:
    cache = small_cache()
    with pytest.raises(ValueError, match=str(bad)):
        cache.prefill_time(bad)
    with pytest.raises(ValueError, match=str(bad)):
        cache.remaining_time(bad, 0)
    with pytest.raises(ValueError, match=str(bad)):
        cache.remaining_time(100, bad)


def test_linear_model_values_by_hand() -> None:
    # 1e-3 + 1e-5*n <= 0.05 -> chunks of 2048 (max chunk) at 0.02148 s each.
    cache = small_cache()
    assert close(cache.prefill_time(2048), 0.02148)
    assert close(cache.prefill_time(4096), 2 * 0.02148)
    assert close(cache.prefill_time(4100), 2 * 0.02148 + 1e-3 + 4e-5)  # last-chunk correction
    assert close(cache.remaining_time(4100, 2048), 0.02148 + 1e-3 + 4e-5)
    assert cache.max_feasible_tokens == math.inf


# ------------------------------------------------------------------ feasibility
# Affine, kvp=1: a 10-token chunk at KV k costs 1e-3 + 1e-6*10*(k+10). With
# T = 0.01105 it fits iff k <= 995. Beyond KV 482 only 10-token chunks fit
# (a 20-token one needs 20*(k+20) <= 10050), so the boundaries step by 10 and
# the first one where nothing fits is exactly 1000. There a 9-token final
# piece still fits (1e-3 + 1e-6*9*1009 = 0.01008), so the longest feasible
# prompt is 1009 tokens.
FEASIBILITY_MODEL = AffineCostModel(base=1e-3, per_token=0.0, per_attn=1e-6)
FEASIBILITY_T = 0.01105


def feasibility_cache(initial: int) -> PrefillTimeCache:
    return PrefillTimeCache(
        FEASIBILITY_MODEL,
        target_time=FEASIBILITY_T,
        token_grid=10,
        max_chunk_tokens=1000,
        group_token_limit=1 << 20,
        initial_tokens=initial,
    )


def test_max_feasible_tokens_is_where_a_grid_chunk_first_exceeds_t_plus_a_last_piece() -> None:
    cache = feasibility_cache(500)
    assert cache.max_feasible_tokens == math.inf  # not reached yet
    cache.prefill_time(5000)  # extends the table on demand
    assert cache.max_feasible_tokens == 1009
    cache.prefill_time(50_000)
    assert cache.max_feasible_tokens == 1009  # the first such position, for good
    assert feasibility_cache(5000).max_feasible_tokens == 1009


def test_max_feasible_tokens_stays_infinite_when_every_grid_chunk_fits() -> None:
    cache = small_cache(max_chunk_tokens=4096)
    cache.prefill_time(200_000)
    assert cache.max_feasible_tokens == math.inf
    # Even with attention cost, a short table that never reaches the wall is infinite.
    assert feasibility_cache(900).max_feasible_tokens == math.inf


def feasibility_scheduler() -> Scheduler:
    config = SchedulerConfig(
        target_batch_time=FEASIBILITY_T, token_grid=10, max_chunk_tokens=1000, min_deadline=0.1
    )
    return Scheduler(config, FEASIBILITY_MODEL)


def test_scheduler_rejects_prompt_longer_than_max_feasible() -> None:
    sched = feasibility_scheduler()
    assert sched.prefill_times.max_feasible_tokens == 1009
    assert sched.max_prompt_tokens == 1009
    with pytest.raises(RequestTooLongError, match=r"'too-long'.*1011"):
        sched.add_request(Request("too-long", 0.0, 1011, 1))
    assert sched.get_request("too-long") is None
    # The longest feasible prompt is accepted and prefilled within budget.
    sched.add_request(Request("ok", 0.0, 1009, 1))
    now, finished = 0.0, ()
    for _ in range(500):
        out = sched.schedule(now)
        assert out.chunks, "a feasible prompt must keep making progress"
        assert out.predicted_time <= FEASIBILITY_T * (1 + 1e-9)
        now += out.predicted_time
        sampled = {c.request_id: 7 for c in out.chunks if c.samples}
        finished = sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))
        if finished:
            break
    assert finished == ("ok",)


def test_scheduler_rejects_infeasible_prompt_beyond_the_initial_table() -> None:
    # Regression: add_request must extend the prefill table to the prompt's
    # length before checking feasibility. The table starts at 8192 tokens;
    # with this model (32-token chunk at KV k costs 1e-3 + 1e-7*32*(k+32)) no
    # grid chunk fits T=0.05 from KV 15296 on, where a 31-token final piece
    # still fits (1e-3 + 1e-7*31*15327 = 0.0485), so a 20000-token prompt can
    # never be prefilled. Before the fix it was accepted and stalled forever.
    model = AffineCostModel(base=1e-3, per_token=0.0, per_attn=1e-7)
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05, token_grid=32), model)
    with pytest.raises(RequestTooLongError, match=r"'big'.*20000"):
        sched.add_request(Request("big", 0.0, 20000, 1))
    assert sched.prefill_times.max_feasible_tokens == 15296 + 31


# ------------------------------------------------------------------ build cost
@dataclass(frozen=True, kw_only=True)
class CountingPoly(PolyCostModel):
    """PolyCostModel that counts ``features`` calls (one per work priced)."""

    counter: list = field(default_factory=lambda: [0], compare=False)

    def features(self, q_tokens, kv_tokens, tail):
        self.counter[0] += 1
        return super().features(q_tokens, kv_tokens, tail)


class CountingOpaque:
    """A non-aggregate cost model: only ``predict``, which is counted."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.layout = inner.layout
        self.calls = 0

    def predict(self, batch: BatchWork) -> float:
        self.calls += 1
        return self.inner.predict(batch)


@pytest.mark.parametrize(
    "coeffs,grid,max_chunk",
    [
        (dict(base=1e-3, a=1e-5, b=1e-9, c=0.0, d=0.0, e=0.0), 32, 2048),
        (dict(base=2e-3, a=2e-6, b=4e-9, c=1e-8, d=1e-10, e=0.0), 16, 4096),
        (dict(base=1e-3, a=1e-6, b=1e-8, c=0.0, d=0.0, e=0.0), 1, 512),
    ],
)
def test_build_is_one_pass(coeffs, grid, max_chunk) -> None:
    n, target, group_limit = 30_000, 0.05, 1 << 20
    model = CountingPoly(**coeffs)
    cache = PrefillTimeCache(
        model,
        target_time=target,
        token_grid=grid,
        max_chunk_tokens=max_chunk,
        group_token_limit=group_limit,
        initial_tokens=n,
    )
    calls = model.counter[0]
    sim = simulate(PolyCostModel(**coeffs), target, grid, max_chunk, group_limit, n)
    boundaries = len(sim.bounds) - 1
    assert cache.built_tokens == sim.bounds[-1] >= n
    per_boundary = math.log2(max_chunk / grid) + 3
    assert boundaries <= calls <= boundaries * per_boundary, (calls, boundaries)
    # A lookup inside the table is O(1) model calls (at most the last-chunk correction).
    model.counter[0] = 0
    cache.prefill_time(n - 1)
    cache.remaining_time(n - 1, n // 3)
    assert model.counter[0] <= 3

    opaque = CountingOpaque(PolyCostModel(**coeffs))
    PrefillTimeCache(
        opaque,
        target_time=target,
        token_grid=grid,
        max_chunk_tokens=max_chunk,
        group_token_limit=group_limit,
        initial_tokens=n,
    )
    assert boundaries <= opaque.calls <= boundaries * per_boundary, (opaque.calls, boundaries)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"max_chunk_tokens": 0}, "max_chunk_tokens must be an integer >= 1, got 0"),
        ({"group_token_limit": 0}, "group_token_limit must be an integer >= 1, got 0"),
        ({"token_grid": 0}, "token_grid must be an integer >= 1, got 0"),
        ({"target_time": float("nan")}, "target_time must be a finite number > 0.0, got nan"),
        ({"target_time": 0.0}, r"target_time must be a finite number > 0.0, got 0.0"),
        ({"initial_tokens": -1}, "initial_tokens must be an integer >= 0, got -1"),
    ],
)
def test_a_cache_built_alone_refuses_bad_settings_by_name(bad, match) -> None:
    """Built outside the scheduler (whose config is validated), max_chunk_tokens=0
    looped forever, group_token_limit=0 raised ZeroDivisionError, and a NaN or zero
    budget built a table silently."""
    model = AffineCostModel(base=2e-3, per_token=2e-5, per_attn=1e-9)
    args = {"target_time": 0.05, "token_grid": 32, "max_chunk_tokens": 64}
    with pytest.raises(ValueError, match=match):
        PrefillTimeCache(model, **{**args, "group_token_limit": 1024, **bad})
