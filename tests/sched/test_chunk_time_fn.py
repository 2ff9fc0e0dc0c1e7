"""``RooflineCostModel.chunk_time_fn`` prices a tail chunk on top of summed
features exactly as ``group_time(base + features(n, start, True))`` does (bit
for bit), and ``ChunkSizer.adaptive_alone`` gives the same chunk, time and
hint with it as without it."""

from __future__ import annotations

import random

import pytest

from medha_sched.chunking import largest_chunk_priced, largest_chunk_within
from medha_sched.config import ParallelDegrees
from medha_sched.cost.affine import AffineCostModel
from medha_sched.cost.roofline import RooflineCostModel
from medha_sched.prefill_cache import PrefillTimeCache
from medha_sched.scheduler import Scheduler
from medha_sched.sim.runner import RunSpec
from tests.sched.mixed_queue import add_mixed_requests


@pytest.mark.parametrize(("tp", "spp", "kvp"), [(1, 1, 1), (8, 2, 1), (8, 4, 2), (2, 1, 4)])
def test_chunk_time_fn_equals_group_time_of_the_sums(tp: int, spp: int, kvp: int) -> None:
    model = RooflineCostModel.from_spec(
        {"model": "llama3-8b", "gpu": "a100"}, layout=ParallelDegrees(tp=tp, spp=spp, kvp=kvp)
    )
    rng = random.Random(tp * 100 + spp * 10 + kvp)
    compute_bound = memory_bound = alone = 0
    for _ in range(3_000):
        base = None
        if rng.random() < 0.8:
            feats = [
                model.features(1, rng.randint(1, 300_000), True) for _ in range(rng.randint(1, 60))
            ]
            base = [sum(col) for col in zip(*feats, strict=True)]
        start = rng.choice([0, rng.randint(1, 5_000), rng.randint(1, 400_000)])
        time_of = model.chunk_time_fn(base, start)
        assert time_of is not None
        for _ in range(4):
            n = rng.choice([1, rng.randint(1, 512), rng.randint(1, 16_384)])
            feats_n = model.features(n, start, True)
            row = list(feats_n) if base is None else [b + f for b, f in zip(base, feats_n)]  # noqa: B905
            want = model.group_time(row)
            assert time_of(n) == want
            assert type(time_of(n)) is type(want)
            compute_bound += n * start > 10**8
            memory_bound += n < 64 and base is not None
            alone += base is None
    assert compute_bound > 100 and memory_bound > 100 and alone > 100


def test_chunk_time_fn_only_where_it_applies() -> None:
    affine = AffineCostModel(base=0.004, per_token=2e-5, per_attn=2e-10)
    assert affine.chunk_time_fn([1, 2, 3], 0) is None
    assert affine.chunk_price() is None

    class Slower(RooflineCostModel):
        def group_time(self, totals):  # type: ignore[no-untyped-def]
            return 2.0 * super().group_time(totals)

    slower = Slower.from_spec({"model": "llama3-8b", "gpu": "a100"})
    assert slower.chunk_time_fn(None, 0) is None
    assert slower.chunk_price() is None


@pytest.mark.parametrize("policy", ["lars-mp", "lars", "fcfs", "edf"])
def test_adaptive_alone_with_chunk_time_equals_without(policy: str) -> None:
    config, model, cache = RunSpec(
        policy=policy,
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=2,
        target_batch_time=0.05,
    ).build()
    sched = Scheduler(config, model, cache=cache)
    sizer = sched._sizer
    rng = random.Random(11)
    reqs = add_mixed_requests(sched, rng)
    fits = seeded = 0
    for _ in range(3_000):
        r = rng.choice(reqs)
        r.num_scheduled_tokens = rng.randrange(r.num_prefill_tokens)
        base = None
        if rng.random() < 0.7:
            feats = [
                model.features(1, rng.randint(1, 300_000), True) for _ in range(rng.randint(1, 60))
            ]
            base = [sum(col) for col in zip(*feats, strict=True)]
        base_time = 0.0 if base is None else model.group_time(base)
        hint = rng.choice([None, rng.randint(1, 16_384), 512, 2048])
        now = rng.uniform(0.0, 30.0)
        target = config.target_batch_time * rng.choice([1.0, 1.0, 0.5, 0.2])
        sizer.set_hint(r.request_id, hint)
        want = sizer.adaptive_alone(
            r, model.group_time, model.features, base, base_time, target, now
        )
        got = sizer.adaptive_alone(
            r, model.group_time, model.features, base, base_time, target, now, model.chunk_time_fn
        )
        assert got == want
        assert sizer.hint(r.request_id) == hint
        fits += got[0] > 0
        seeded += got[0] > 0 and base is not None
    assert fits > 700 and seeded > 400


def test_largest_chunk_priced_is_largest_chunk_within() -> None:
    """The same answer, the same probes in the same order, and the chunk's time."""
    model = RooflineCostModel.from_spec({"model": "llama3-8b", "gpu": "a100"})
    price = model.chunk_price()
    assert price is not None and model.chunk_price() is price  # built once
    rng = random.Random(3)
    found = none = 0
    for _ in range(3_000):
        base = None
        if rng.random() < 0.7:
            feats = [
                model.features(1, rng.randint(1, 300_000), True) for _ in range(rng.randint(1, 60))
            ]
            base = [sum(col) for col in zip(*feats, strict=True)]
        start = rng.choice([0, rng.randint(1, 5_000), rng.randint(1, 400_000)])
        base_time = 0.0 if base is None else model.group_time(base)
        target = rng.choice([0.05, 0.025, 0.01, base_time + 1e-4])
        limit = rng.choice([rng.randint(1, 100), rng.randint(1, 20_000), 16_384])
        grid = rng.choice([1, 16, 128, 512])
        hint = rng.choice([0, rng.randint(1, 20_000), 2048])
        calls_want: list[int] = []
        calls_got: list[int] = []

        def time_of(n: int, base=base, start=start, calls=calls_want) -> float:
            calls.append(n)
            return model.group_time(
                list(model.features(n, start, True))
                if base is None
                else [b + f for b, f in zip(base, model.features(n, start, True))]  # noqa: B905
            )

        def counted(b, s, n: int, calls=calls_got) -> float:
            calls.append(n)
            return price(b, s, n)

        want = largest_chunk_within(limit, grid, time_of, target, base=base_time, hint=hint)
        got, t = largest_chunk_priced(limit, grid, counted, base, start, target, base_time, hint)
        assert got == want
        assert calls_got == calls_want
        assert t == (time_of(got) if got else 0.0)
        found += got > 0
        none += got == 0
    assert found > 300 and none > 100


def test_prefill_table_priced_by_chunk_price_equals_group_time() -> None:
    """The prefill-time table (built and looked up) gives the same floats with
    the model's ``chunk_price`` as with ``group_time`` of the summed features."""
    config, model, _ = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=2,
        target_batch_time=0.05,
    ).build()
    table = {
        "target_time": 0.05,
        "token_grid": config.token_grid,
        "max_chunk_tokens": config.max_chunk_tokens,
        "group_token_limit": 1 << 20,
    }

    class NoPrice(RooflineCostModel):
        def chunk_price(self):  # type: ignore[no-untyped-def]
            return None  # group_time of the summed features, as before chunk_price

    plain = NoPrice.from_spec({"model": "llama3-8b", "gpu": "a100"}, layout=model.layout)
    fast = PrefillTimeCache(model, **table)
    slow = PrefillTimeCache(plain, **table)
    assert fast._price is not None and slow._price is None
    rng = random.Random(5)
    for n in [0, 1, 511, 512, 513, *(rng.randint(1, 600_000) for _ in range(3_000))]:
        assert fast.prefill_time(n) == slow.prefill_time(n)
        done = rng.randint(0, n)
        assert fast.remaining_time(n, done) == slow.remaining_time(n, done)
    assert fast._bounds == slow._bounds and fast._cum == slow._cum


def test_a_scheduler_with_a_priced_prefill_table_pickles() -> None:
    """The table's chunk pricer is a closure: a pickled scheduler (and its table)
    drops it and asks the model again when loaded, with the same floats."""
    import pickle

    config, model, _ = RunSpec(
        policy="lars-mp",
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=2,
        target_batch_time=0.05,
    ).build()
    sched = Scheduler(config, model)
    table = PrefillTimeCache(
        model,
        target_time=0.05,
        token_grid=config.token_grid,
        max_chunk_tokens=config.max_chunk_tokens,
        group_token_limit=1_000_000,
    )
    assert table._price is not None
    copy = pickle.loads(pickle.dumps(table))
    again = pickle.loads(pickle.dumps(sched))
    assert copy._price is not None and type(again) is Scheduler
    for n in [1, 512, 70_000, 600_000]:
        assert copy.prefill_time(n) == table.prefill_time(n)
