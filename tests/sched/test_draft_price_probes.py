"""Drafts of one KVP group probe tail chunks with the model's ``chunk_price``.

``BatchCost(model, 1, price=model.chunk_price())`` prices a one-shard tail
chunk with one call (``price(totals, start, n)``) instead of summing the
features and calling ``group_time``, and sums the totals only for the chunk
that joins (``add``). ``ChunkSizer.adaptive`` searches with
``largest_chunk_priced`` over ``BatchCost.tail_price`` instead of
``largest_chunk_within`` over a ``time_with_tail`` closure. Both must change
nothing: the same probes in the same order, the same chunk, hint and misses,
and the same time and totals after ``add``, bit for bit. The scheduler's
drafts use the priced probes; whole simulations must give the same records
and iterations as drafts without them. ``PrefillTimeCache.remaining_time``
reads ``prefill_time``'s memo itself; it must return what the two calls did.
"""

from __future__ import annotations

import random

import pytest

import medha_sched.prefill_cache as prefill_cache
from medha_sched.batch_cost import BatchCost, chunk_works
from medha_sched.chunking import largest_chunk_within
from medha_sched.cost import RooflineCostModel
from medha_sched.packer import Draft
from medha_sched.request import Request
from medha_sched.scheduler import Scheduler
from medha_sched.sim.runner import RunSpec
from medha_sched.sim.workload import WorkloadSpec, generate
from tests.sched.mixed_queue import add_mixed_requests
from tests.sim.same import assert_same_results, simulate

ROOFLINE = "roofline:model=llama3-8b,gpu=a100"


def _old_adaptive(sizer, request, draft, now):
    """``ChunkSizer.adaptive`` for one group and one shard as it was before
    (``largest_chunk_within`` over a ``time_with_tail`` closure), recording
    the probes: ``(chunk, is_long, probes)``. Only the one-shard path."""
    from medha_sched.policies.base import relative_slack

    cfg = sizer._cfg
    start = request.num_scheduled_tokens
    is_long = request.num_prefill_tokens >= cfg.long_prefill_threshold
    target = draft.target
    probes: list[int] = []
    if is_long:
        if draft.long_groups.intersection((0,)):
            return 0, is_long, probes
        if sizer._policy.space_sharing:
            rho = min(cfg.max_space_share, max(0.0, relative_slack(request, now)))
            target *= 1.0 - rho
    cost = draft.cost
    if cost.time >= target:
        return 0, is_long, probes
    limit = min(request.num_prefill_tokens - start, cfg.max_chunk_tokens)
    limit = min(limit, sizer._limit - start % sizer._limit)
    grid = cfg.token_grid
    if draft.misses and draft.known_miss(0, start, min(grid, limit), target):
        return 0, is_long, probes

    def time_of(n: int) -> float:
        probes.append(n)
        return cost.time_with_tail(0, n, start)

    rid = request.request_id
    hint = sizer._last_chunk.get(rid, 0)
    chunk = largest_chunk_within(limit, grid, time_of, target, base=cost.time, hint=hint)
    if chunk == 0:
        draft.misses.append((0, start, min(grid, limit), target))
    elif start + chunk < request.num_prefill_tokens:
        sizer._last_chunk[rid] = chunk
    elif hint:
        del sizer._last_chunk[rid]
    return chunk, is_long, probes


def _draft_state(draft: Draft):
    cost = draft.cost
    return (
        cost.time,
        [None if t is None else list(t) for t in cost._totals],
        list(cost._group_times),
        list(draft.misses),
        [(r.request_id, n) for r, n in draft.entries],
    )


@pytest.mark.parametrize("searched", [False, True])
@pytest.mark.parametrize("policy", ["lars-mp", "lars", "fcfs", "edf"])
def test_priced_sizing_matches_the_summed_probes(policy: str, searched: bool) -> None:
    """``searched`` False: the price probed by ``largest_chunk_priced`` (the
    same probes, in order); True: the roofline's own search (the same chunk,
    hint, misses and draft after ``add``; only the chosen chunk's probe noted,
    the time the summed path had for it)."""
    config, model, cache = RunSpec(
        policy=policy, cost_model=ROOFLINE, tp=8, spp=2, target_batch_time=0.05
    ).build()
    assert isinstance(model, RooflineCostModel)
    price = model.chunk_price()
    assert price is not None
    sched = Scheduler(config, model, cache=cache)
    sizer, limit_g = sched._sizer, sched.group_limit
    rng = random.Random(11)
    reqs = add_mixed_requests(sched, rng)
    joined = zero = two = lowered = 0
    for _ in range(1_500):
        target = config.target_batch_time * rng.choice([1.0, 1.0, 0.5, 0.2])
        base = None
        if rng.random() < 0.7:  # a lane's decodes, summed as DecodeLanes.totals does
            feats = [
                model.features(1, rng.randint(1, 300_000), True) for _ in range(rng.randint(1, 60))
            ]
            base = [sum(col) for col in zip(*feats, strict=True)]
        old = Draft(BatchCost(model, 1), target)
        new = Draft(BatchCost(model, 1, price=price), target)
        if not searched:
            new.cost._search = None
        if base is not None:
            old.cost.seed([list(base)])
            new.cost.seed([list(base)])
        if rng.random() < 0.3:  # the floor probe of _lower_floor, on both
            tokens = rng.choice([1, 512, 2048])
            assert old.cost.time_with_tail(0, tokens, 0) == new.cost.time_with_tail(0, tokens, 0)
            lowered += 1
        now = rng.uniform(0.0, 30.0)
        for _ in range(rng.randint(1, 3)):  # chunks join one after another
            r = rng.choice(reqs)
            rid = r.request_id
            r.num_scheduled_tokens = rng.randrange(min(r.num_prefill_tokens, limit_g - 1))
            hint = rng.choice([None, rng.randint(1, 16_384), 512, 2048])
            sizer.set_hint(rid, hint)
            want, want_long, want_probes = _old_adaptive(sizer, r, old, now)
            want_hint = sizer.hint(rid)
            sizer.set_hint(rid, hint)
            got_probes: list[int] = []
            cost = new.cost

            def recording(base, start, n, _price=price, _seen=got_probes):
                _seen.append(n)
                return _price(base, start, n)

            cost._price = recording
            got, got_long = sizer.adaptive(r, (0,), new, now)
            cost._price = price
            assert (got, got_long, sizer.hint(rid)) == (want, want_long, want_hint)
            if searched:  # the chosen chunk's probe, as the summed path timed it
                for work, (_, time) in cost._probes.items():
                    assert old.cost._probes[work][1] == time
                assert len(cost._probes) <= len(old.cost._probes)
            else:
                assert got_probes == want_probes  # the same probes, in the same order
                assert list(cost._probes) == list(old.cost._probes)
                assert [p[1] for p in cost._probes.values()] == [
                    p[1] for p in old.cost._probes.values()
                ]
            if want:
                start = r.num_scheduled_tokens
                old.add(r, want, chunk_works((0,), start, want, limit_g))
                new.add(r, got, chunk_works((0,), start, got, limit_g))
                joined += 1
                two += len(old.entries) > 1
            else:
                zero += 1
            assert _draft_state(new) == _draft_state(old)
    assert joined > 500 and zero > 100 and two > 150 and lowered > 300


def test_a_draft_without_price_or_with_several_groups_sums_as_before() -> None:
    _, model, _ = RunSpec(cost_model=ROOFLINE, tp=8, spp=2, kvp=2).build()
    price = model.chunk_price()
    assert price is not None
    two = BatchCost(model, 2, price=price)  # several groups: the price is not used
    assert two._price is None
    plain = BatchCost(model, 1)
    assert plain._price is None
    priced = BatchCost(model, 1, price=price)
    t = priced.tail_price(0, 700, 300)
    assert priced._probes[(0, 300, 700, True)] == (None, t)  # summed only if it joins
    assert t == plain.tail_price(0, 700, 300) == model.group_time(model.features(300, 700, True))
    priced.add([(0, 300, 700, True)])
    plain.add([(0, 300, 700, True)])
    assert priced._totals == plain._totals and priced.time == plain.time


@pytest.mark.parametrize(
    ("qps", "spp", "caching"), [(0.5, 2, True), (2.0, 2, True), (2.0, 4, False)]
)
def test_simulations_match_drafts_without_price(monkeypatch, qps, spp, caching) -> None:
    trace = generate(WorkloadSpec(qps=qps, num_requests=150, long_fraction=0.08, seed=3))
    spec = RunSpec(
        policy="lars-mp",
        cost_model=ROOFLINE,
        tp=8,
        spp=spp,
        target_batch_time=0.05,
        prefix_caching=caching,
    )
    priced_calls = [0]
    tail_price = BatchCost.tail_price

    def counting(self, group, kv_tokens, q_tokens):
        priced_calls[0] += self._price is not None
        return tail_price(self, group, kv_tokens, q_tokens)

    largest = BatchCost.largest_tail_chunk

    def counting_searches(self, *args):
        priced_calls[0] += self._search is not None
        return largest(self, *args)

    fits_tail = BatchCost.fits_tail

    def counting_bounds(self, q_tokens, target):
        told = fits_tail(self, q_tokens, target)
        priced_calls[0] += told is not None  # a floor probe the price's bounds told
        return told

    monkeypatch.setattr(BatchCost, "tail_price", counting)
    monkeypatch.setattr(BatchCost, "largest_tail_chunk", counting_searches)
    monkeypatch.setattr(BatchCost, "fits_tail", counting_bounds)
    priced = simulate(trace, spec)
    # the drafts did probe with the price (or its search, or its bound)
    assert priced_calls[0] > 1_000
    monkeypatch.setattr(Scheduler, "_new_draft", _unpriced_draft)
    assert_same_results(priced, simulate(trace, spec))


def _unpriced_draft(self: Scheduler) -> Draft:
    return Draft(BatchCost(self.cost_model, self.layout.kvp), self._target_time())


@pytest.mark.parametrize("recent_max", [3, 1 << 16])
def test_remaining_time_reads_the_memo_as_prefill_time_does(monkeypatch, recent_max) -> None:
    monkeypatch.setattr(prefill_cache, "_RECENT_MAX", recent_max)
    _, model, _ = RunSpec(cost_model=ROOFLINE, tp=8, spp=2).build()
    args = dict(target_time=0.05, token_grid=32, max_chunk_tokens=8192, group_token_limit=1 << 20)
    ours = prefill_cache.PrefillTimeCache(model, **args, initial_tokens=4096)
    ref = prefill_cache.PrefillTimeCache(model, **args, initial_tokens=4096)
    spp = model.layout.spp
    rng = random.Random(5)
    hits = 0
    for _ in range(4_000):
        total = rng.choice([rng.randint(1, 300_000), 1024, 70_000, 123_457])
        done = rng.choice([0, rng.randint(0, total), total, total + 5, 512])
        # kept in the memo, or in the array of positions remaining_time keeps
        hits += total in ours._recent or (total < len(ours._at) and ours._at[total] >= 0.0)
        got = ours.remaining_time(total, done)
        if done >= total:
            want = 0.0
        else:  # the two prefill_time calls remaining_time made before
            span = max(0.0, ref.prefill_time(total) - ref.prefill_time(done))
            want = span / spp + (1.0 - 1.0 / spp) * ref._target
        assert got == want
        assert ours.built_tokens == ref.built_tokens
    assert hits > 500  # the memo answered many lookups


def test_a_pickled_scheduler_prices_its_drafts_again() -> None:
    import pickle

    config, model, cache = RunSpec(cost_model=ROOFLINE, tp=8, spp=2).build()
    sched = Scheduler(config, model, cache=cache)
    assert sched._draft_price is model.chunk_price()
    again = pickle.loads(pickle.dumps(sched))
    assert again._draft_price is not None
    assert again._new_draft().cost._price is again._draft_price


def _old_register(self: Scheduler, request: Request) -> None:
    """``Scheduler._register`` before it returned early for an unhashable request."""
    done = request.num_computed_tokens
    self.memory.register_blocks(request.request_id, self._hashes(request, done), done)


def test_register_skips_only_requests_without_hashable_blocks(monkeypatch) -> None:
    """Requests with a shared prefix (hashable) among ones without: the prefix
    cache hits and every record are as when every request is offered."""
    from medha_sched.sim import TraceRequest

    trace = [
        TraceRequest(
            f"s{i}",
            0.05 * i,
            300 + 37 * (i % 11),
            4 + i % 9,
            prefix_id="doc" if i % 3 == 0 else None,
            prefix_tokens=256 if i % 3 == 0 else 0,
        )
        for i in range(120)
    ] + [TraceRequest("long", 1.0, 60_000, 5, prefix_id="doc", prefix_tokens=256)]
    trace.sort(key=lambda r: (r.arrival_s, r.id))
    spec = RunSpec(policy="lars-mp", cost_model=ROOFLINE, tp=8, spp=2, target_batch_time=0.05)
    new = simulate(trace, spec)
    assert new.prefix_cache_hits > 5_000  # the shared prefix was offered and found
    monkeypatch.setattr(Scheduler, "_register", _old_register)
    assert_same_results(new, simulate(trace, spec))
