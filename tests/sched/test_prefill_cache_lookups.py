"""``PrefillTimeCache``'s lookups read the table's recent values first: the
answers (and the errors) must be those of the plain lookups, repeated or not."""

from __future__ import annotations

import bisect
import random

import pytest

from medha_sched.config import ParallelDegrees
from medha_sched.cost.registry import parse_cost_model_spec
from medha_sched.prefill_cache import PrefillTimeCache


def _plain_prefill_time(cache: PrefillTimeCache, n: int) -> float:
    """C(L) from the table alone (no recent values)."""
    if n > cache._bounds[-1]:
        cache._extend_to(max(n, 2 * cache._bounds[-1]))
    k = bisect.bisect_right(cache._bounds, n) - 1
    base = cache._bounds[k]
    if base == n:
        return cache._cum[k]
    return cache._cum[k] + cache._chunk_time(base, n - base)


def _plain_remaining(cache: PrefillTimeCache, tokens: int, done: int) -> float:
    if done >= tokens:
        return 0.0
    span = max(0.0, _plain_prefill_time(cache, tokens) - _plain_prefill_time(cache, done))
    spp = cache._spp
    return span / spp + (1.0 - 1.0 / spp) * cache._target


@pytest.mark.parametrize(
    ("spec", "spp", "kvp"),
    [
        ("roofline:model=llama3-8b,gpu=a100", 2, 1),
        ("roofline:model=llama3-8b,gpu=a100", 4, 2),
        ("affine:base=0.004,per_token=0.00002,per_attn=0.0000000002", 3, 1),
    ],
)
def test_lookups_match_the_plain_table(spec: str, spp: int, kvp: int) -> None:
    model = parse_cost_model_spec(spec, layout=ParallelDegrees(tp=8, spp=spp, kvp=kvp))
    cache = PrefillTimeCache(
        model,
        target_time=0.05,
        token_grid=32,
        max_chunk_tokens=1 << 14,
        group_token_limit=1 << 17,
        initial_tokens=4096,
    )
    rng = random.Random(spp * 10 + kvp)
    lengths = [0, 1, 31, 32, 4096, 5000, 200_000, 300_000]
    lengths += [rng.randrange(300_000) for _ in range(300)]
    lengths += list(cache._bounds[:20])  # boundaries (no recent value is kept for them)
    for _ in range(3):  # the first lookup fills the recent values; the others read them
        for n in lengths:
            assert cache.prefill_time(n) == _plain_prefill_time(cache, n)
        for _ in range(600):
            tokens = rng.choice(lengths)
            done = rng.choice([0, tokens, tokens + 5, rng.randrange(tokens + 1)])
            got = cache.remaining_time(tokens, done)
            assert got == _plain_remaining(cache, tokens, done), (tokens, done)
    assert cache.remaining_time(7, 7) == 0.0 and cache.remaining_time(5, 9) == 0.0
    assert cache.remaining_time(1, 0) > (1.0 - 1.0 / spp) * 0.05
    for bad in [(-1, 0), (5, -1), (-3, -1), (-1, -3), (-2, 4)]:
        with pytest.raises(ValueError, match="token counts must be >= 0"):
            cache.remaining_time(*bad)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        cache.prefill_time(-1)


@pytest.mark.parametrize("at_max", [1, 40, 5000, 1 << 20])
def test_positions_kept_in_the_array_answer_as_the_table(monkeypatch, at_max: int) -> None:
    """``remaining_time`` reads a length's and a done position's C(L) from
    ``_at`` (filled by its first lookup, up to ``_AT_MAX``, beyond it the
    memo): the same floats as the plain table, repeated or not, and after a
    pickle."""
    import pickle

    from medha_sched import prefill_cache

    monkeypatch.setattr(prefill_cache, "_AT_MAX", at_max)
    model = parse_cost_model_spec(
        "roofline:model=llama3-8b,gpu=a100", layout=ParallelDegrees(tp=8, spp=2)
    )
    cache = PrefillTimeCache(
        model, target_time=0.05, token_grid=32, max_chunk_tokens=8192, group_token_limit=1 << 20
    )
    rng = random.Random(at_max)
    for i in range(3000):
        tokens = rng.choice([rng.randrange(1, 200_000), 4096, 70_001])
        done = rng.choice([32 * rng.randrange(tokens // 32 + 1), rng.randrange(tokens + 1), 39])
        assert cache.remaining_time(tokens, done) == _plain_remaining(cache, tokens, done)
        if i == 1500:
            cache = pickle.loads(pickle.dumps(cache))
    assert len(cache._at) <= at_max
    kept = [(n, v) for n, v in enumerate(cache._at) if v >= 0.0]
    assert kept or at_max == 1
    assert all(v == _plain_prefill_time(cache, n) for n, v in kept)
    state = cache.__getstate__()
    del state["_at"]  # pickled before the array was kept
    old = PrefillTimeCache.__new__(PrefillTimeCache)
    old.__setstate__(state)
    assert old.remaining_time(5000, 64) == _plain_remaining(cache, 5000, 64)
