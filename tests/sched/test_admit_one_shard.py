"""``KVBlockManager.admit_one_shard`` (the scheduler's admission after a
one-group plan) gives what ``admit`` gives: the same blocks, table and
bookkeeping, over a random sequence of admissions, growths and frees."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_sched.config import CacheConfig
from medha_sched.errors import SchedulerError
from medha_sched.kv_memory import KVBlockManager


def make(groups: int) -> KVBlockManager:
    cache = CacheConfig(
        block_size=4, num_blocks_per_group=64, max_tokens_per_group=4 * 48, watermark=0.05
    )
    return KVBlockManager(cache, num_groups=groups)


def state(m: KVBlockManager) -> tuple:
    tables = {
        rid: (e.groups, [list(b) for b in e.blocks], e.tokens, dict(e.pending))
        for rid, e in m._entries.items()
    }
    pools = [(list(p._free), list(p._ref)) for p in m._pools]
    holders = [sorted(h) for h in m._holders]
    return tables, pools, holders


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), groups=st.integers(1, 3))
def test_same_state_as_admit(seed: int, groups: int) -> None:
    rng = random.Random(seed)
    a, b = make(groups), make(groups)
    live: list[int] = []
    admitted = 0
    for rid in range(80):
        op = rng.random()
        if op < 0.5:
            tokens = rng.randint(1, 4 * 48)  # one shard
            plan = a.plan_admit(tokens)
            assert plan == b.plan_admit(tokens)
            if plan is None:
                continue
            assert a.admit(rid, tokens)
            b.admit_one_shard(rid, tokens, plan[0])
            live.append(rid)
            admitted += 1
        elif op < 0.75 and live:
            rid_ = rng.choice(live)
            want = a._entries[rid_].tokens + rng.randint(1, 8)
            assert a.ensure_capacity(rid_, want) == b.ensure_capacity(rid_, want)
        elif live:
            rid_ = live.pop(rng.randrange(len(live)))
            a.free(rid_)
            b.free(rid_)
        assert state(a) == state(b)
    assert admitted, "nothing was admitted"
    for rid_ in live:
        assert a.pop_new_blocks(rid_) == b.pop_new_blocks(rid_)


def test_admitting_twice_is_refused() -> None:
    m = make(1)
    m.admit_one_shard("r", 10, 0)
    with pytest.raises(SchedulerError, match="already admitted"):
        m.admit_one_shard("r", 10, 0)
