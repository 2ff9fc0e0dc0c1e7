"""Tests for medha_sched.kv_memory: unit cases plus a stateful property test."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from medha_sched.config import CacheConfig
from medha_sched.kv_memory import KVBlockManager


def make(bs=4, blocks=10, g_blocks=4, wm=0.0, groups=3) -> KVBlockManager:
    cache = CacheConfig(
        block_size=bs, num_blocks_per_group=blocks, max_tokens_per_group=bs * g_blocks, watermark=wm
    )
    return KVBlockManager(cache, num_groups=groups)


def free_counts(m: KVBlockManager) -> list[int]:
    return [m.num_free_blocks(g) for g in range(m.num_groups)]


# ---------------------------------------------------------------------- unit tests
def test_whole_prompt_reserved_across_three_groups():
    m = make()  # G = 16 tokens = 4 blocks
    assert m.admit("a", 40)
    assert m.groups_of("a") == (0, 1, 2)
    assert m.tail_group("a") == 2
    assert [len(s) for s in m.block_table("a")] == [4, 4, 2]
    assert m.shard_tokens("a", 40) == (16, 16, 8)
    assert m.shard_tokens("a", 20) == (16, 4, 0)
    assert m.num_tokens_capacity("a") == 40
    assert free_counts(m) == [6, 6, 8]
    assert all("a" in m.holders(g) for g in range(3))
    m.check_invariants()


def test_full_shards_take_roomiest_groups_and_tail_may_be_group_0():
    m = make()
    assert m.admit("small", 4)  # 1 block on group 0 (tie -> lowest id)
    assert m.groups_of("small") == (0,)
    assert m.admit("big", 40)
    assert m.groups_of("big") == (1, 2, 0)
    assert m.tail_group("big") == 0
    assert m.holders(0) == {"small", "big"}
    assert m.holders(1) == {"big"}


def test_group_0_as_tail_group_grows_on_group_0():
    m = make(groups=2)
    assert m.admit("x", 4)  # group 0 now has less free room
    assert m.admit("r", 20)  # full shard on group 1, tail (4 tokens) on group 0
    assert m.groups_of("r") == (1, 0)
    assert m.tail_group("r") == 0
    m.pop_new_blocks("r")
    before = m.num_free_blocks(0), m.num_free_blocks(1)
    assert m.ensure_capacity("r", 21)
    assert m.pop_new_blocks("r") == ((0, (2,)),)
    assert (m.num_free_blocks(0), m.num_free_blocks(1)) == (before[0] - 1, before[1])
    assert [len(s) for s in m.block_table("r")] == [4, 2]
    m.check_invariants()


def test_watermark_refusal_leaves_state_unchanged():
    m = make(bs=1, blocks=10, g_blocks=10, wm=0.2, groups=1)  # 2 blocks must stay free
    assert m.cache.watermark_blocks == 2
    assert not m.can_admit(9)
    assert not m.admit("r", 9)
    assert "r" not in m
    assert free_counts(m) == [10]
    assert m.usage() == 0.0
    assert m.num_block_allocs == 0
    m.check_invariants()
    assert m.can_admit(8)
    assert m.admit("r", 8)
    assert free_counts(m) == [2]
    # growth ignores the watermark
    assert m.ensure_capacity("r", 10)
    assert free_counts(m) == [0]


def test_admission_refused_when_more_shards_than_groups():
    m = make(groups=2)
    assert not m.admit("r", 33)  # needs 3 shards of 16
    assert not m.can_ever_admit(33)
    assert m.can_ever_admit(32)
    assert "r" not in m and free_counts(m) == [10, 10]


def test_decode_growth_across_group_boundary_opens_new_group():
    m = make(bs=4, blocks=6, g_blocks=2, wm=0.5, groups=3)  # G = 8, watermark 3 blocks
    assert m.admit("busy", 12)  # full shard on 0, tail on 1
    assert m.admit("r", 8)  # one full shard on 2 (most free)
    assert m.groups_of("r") == (2,)
    m.pop_new_blocks("r")
    assert m.ensure_capacity("r", 8)  # already held: no new block
    assert m.pop_new_blocks("r") == ()
    assert free_counts(m) == [4, 5, 4]
    assert m.ensure_capacity("r", 9)  # tail full -> new shard on roomiest unused group
    assert m.groups_of("r") == (2, 1)
    assert m.tail_group("r") == 1
    assert m.pop_new_blocks("r") == ((1, (1,)),)
    assert m.num_tokens_capacity("r") == 12
    assert m.shard_tokens("r", 9) == (8, 1)
    m.check_invariants()


def test_growth_refused_when_tail_group_full():
    m = make(bs=2, blocks=3, g_blocks=3, groups=1)
    assert m.admit("a", 2)
    assert m.admit("b", 4)
    table, cap = m.block_table("a"), m.num_tokens_capacity("a")
    assert m.ensure_capacity("a", 2)
    assert not m.ensure_capacity("a", 3)
    assert m.block_table("a") == table and m.num_tokens_capacity("a") == cap
    assert free_counts(m) == [0]
    m.check_invariants()


def test_growth_refused_when_groups_run_out():
    m = make(bs=2, blocks=2, g_blocks=2, groups=2)
    assert m.admit("a", 4) and m.admit("b", 4)
    assert not m.ensure_capacity("a", 5)  # group 1 has no room for a new shard
    m.free("b")
    assert m.ensure_capacity("a", 8)
    assert not m.ensure_capacity("a", 9)  # would need a third group
    assert m.groups_of("a") == (0, 1)
    m.check_invariants()


def test_double_free_and_double_admit_name_the_request():
    m = make()
    assert m.admit("req-7", 5)
    with pytest.raises(ValueError, match="req-7"):
        m.admit("req-7", 5)
    m.free("req-7")
    with pytest.raises(ValueError, match="req-7"):
        m.free("req-7")
    with pytest.raises(ValueError, match="ghost"):
        m.free("ghost")
    assert m.num_block_allocs == m.num_block_frees == 2
    assert m.usage() == 0.0
    m.check_invariants()


def test_bad_token_counts_raise():
    m = make()
    with pytest.raises(ValueError, match="num_tokens"):
        m.admit("r", 0)
    with pytest.raises(ValueError, match="num_tokens"):
        m.can_admit(-3)
    assert "r" not in m


def test_pop_new_blocks_semantics():
    m = make(groups=2)
    assert m.admit("r", 20)
    assert m.pop_new_blocks("r") == ((0, (0, 1, 2, 3)), (1, (0,)))
    assert m.pop_new_blocks("r") == ()
    assert m.ensure_capacity("r", 25)
    assert m.ensure_capacity("r", 29)
    assert m.pop_new_blocks("r") == ((1, (1, 2, 3)),)  # shard 1 went 4 -> 13 tokens
    assert m.num_tokens_capacity("r") == 32
    m.free("r")
    with pytest.raises(ValueError, match="'r'"):
        m.pop_new_blocks("r")
    assert m.admit("r", 3)  # re-admission after preemption starts afresh
    assert m.pop_new_blocks("r") == ((0, (0,)),)


def _random_ops(seed: int, n: int = 300):
    rng = random.Random(seed)
    return [(rng.choice("aef"), rng.randrange(6), rng.randint(1, 40)) for _ in range(n)]


def _replay(ops) -> list:
    m = make(bs=2, blocks=12, g_blocks=4, wm=0.1, groups=3)
    trace = []
    for op, rid, tokens in ops:
        if op == "a" and rid not in m:
            trace.append(m.admit(rid, tokens))
        elif op == "e" and rid in m:
            trace.append(m.ensure_capacity(rid, m.num_tokens_capacity(rid) + tokens % 5))
        elif op == "f" and rid in m:
            m.free(rid)
        trace.append({r: (m.block_table(r), m.pop_new_blocks(r)) for r in range(6) if r in m})
    return trace


def test_determinism_same_calls_same_block_tables():
    ops = _random_ops(1234)
    first, second = _replay(ops), _replay(ops)
    assert first == second
    assert any(isinstance(x, dict) and len(x) >= 2 for x in first)  # the trace is not trivial


# ------------------------------------------------------------- stateful property test
def _fits(free, groups, needs, reserve) -> bool:
    """Brute force: can shards with ``needs`` go on distinct ``groups``?"""
    return any(
        all(free[g] - need >= reserve for g, need in zip(perm, needs, strict=True))
        for perm in itertools.permutations(groups, len(needs))
    )


class KVMemoryMachine(RuleBasedStateMachine):
    @initialize(
        bs=st.integers(1, 32),
        groups=st.integers(1, 4),
        blocks=st.integers(2, 24),
        data=st.data(),
    )
    def setup(self, bs, groups, blocks, data):
        g_blocks = data.draw(st.integers(1, blocks - 1), label="g_blocks")
        wm = data.draw(st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5]), label="watermark")
        cache = CacheConfig(
            block_size=bs,
            num_blocks_per_group=blocks,
            max_tokens_per_group=bs * g_blocks,
            watermark=wm,
        )
        self.m = KVBlockManager(cache, num_groups=groups)
        self.G, self.bs, self.gb = bs * g_blocks, bs, g_blocks
        self.tokens: dict[int, int] = {}  # shadow: tokens each live request was sized for
        self.owned: dict[int, set[tuple[int, int]]] = {}  # shadow: (group, block) per request
        self.next_id = 0

    def _needs(self, num_tokens: int) -> list[int]:
        n = math.ceil(num_tokens / self.G)
        return [math.ceil(min(self.G, num_tokens - i * self.G) / self.bs) for i in range(n)]

    def _take_new(self, rid: int) -> set[tuple[int, int]]:
        new = {(g, b) for g, blocks in self.m.pop_new_blocks(rid) for b in blocks}
        assert not new & self.owned[rid], "a block was handed out twice"
        self.owned[rid] |= new
        return new

    def _snapshot(self):
        tables = {r: self.m.block_table(r) for r in self.tokens}
        return free_counts(self.m), tables

    @rule(data=st.data())
    def admit(self, data):
        max_tokens = self.G * (self.m.num_groups + 1)
        num_tokens = data.draw(st.integers(1, max_tokens), label="num_tokens")
        rid, self.next_id = self.next_id, self.next_id + 1
        before = self._snapshot()
        predicted = self.m.can_admit(num_tokens)
        needs = self._needs(num_tokens)
        wm = self.m.cache.watermark_blocks
        assert predicted == _fits(before[0], range(self.m.num_groups), needs, wm)
        ok = self.m.admit(rid, num_tokens)
        assert ok == predicted
        if not ok:
            assert rid not in self.m and self._snapshot() == before
            return
        self.tokens[rid], self.owned[rid] = num_tokens, set()
        groups = self.m.groups_of(rid)
        assert len(groups) == len(needs) and len(set(groups)) == len(groups)
        for g, need in zip(groups, needs, strict=True):
            assert self.m.num_free_blocks(g) >= wm, "admission broke the watermark"
            assert self.m.num_free_blocks(g) == before[0][g] - need
        assert len(self._take_new(rid)) == sum(needs)

    @rule(data=st.data(), delta=st.integers(0, 40))
    def grow(self, data, delta):
        if not self.tokens:
            return
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        target = self.tokens[rid] + delta
        before = self._snapshot()
        old_groups, old_cap = self.m.groups_of(rid), self.m.num_tokens_capacity(rid)
        ok = self.m.ensure_capacity(rid, target)
        if not ok:
            assert self._snapshot() == before and self.m.num_tokens_capacity(rid) == old_cap
            needs = self._needs(target)
            n_old = len(old_groups)
            extra_ok = all(
                before[0][g] >= needs[i] - len(before[1][rid][i]) for i, g in enumerate(old_groups)
            )
            unused = [g for g in range(self.m.num_groups) if g not in old_groups]
            assert not (extra_ok and _fits(before[0], unused, needs[n_old:], 0)), "false refusal"
            return
        self.tokens[rid] = max(self.tokens[rid], target)
        assert self.m.num_tokens_capacity(rid) >= target
        assert self.m.groups_of(rid)[: len(old_groups)] == old_groups
        new = self._take_new(rid)
        if target <= old_cap:
            assert not new
        for i, blocks in enumerate(before[1][rid]):  # never shrinks or reorders
            assert self.m.block_table(rid)[i][: len(blocks)] == blocks

    @rule(data=st.data())
    def free(self, data):
        if not self.tokens:
            return
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="rid")
        free_before = free_counts(self.m)
        table, groups = self.m.block_table(rid), self.m.groups_of(rid)
        returned = {(g, b) for g, blocks in zip(groups, table, strict=True) for b in blocks}
        assert returned == self.owned[rid], "free must return exactly the allocated blocks"
        self.m.free(rid)
        for g in range(self.m.num_groups):
            n = sum(1 for gg, _ in returned if gg == g)
            assert self.m.num_free_blocks(g) == free_before[g] + n
            assert rid not in self.m.holders(g)
        with pytest.raises(ValueError, match=str(rid)):
            self.m.free(rid)
        del self.tokens[rid], self.owned[rid]

    @invariant()
    def consistent(self):
        m = self.m
        m.check_invariants()
        total = m.cache.num_blocks_per_group
        for g in range(m.num_groups):
            assert 0 <= m.num_used_blocks(g) <= total, "over capacity"
            assert m.num_used_blocks(g) == sum(
                1 for blocks in self.owned.values() for gg, _ in blocks if gg == g
            )
            assert m.holders(g) == {r for r, bl in self.owned.items() if any(x == g for x, _ in bl)}
        for rid, tokens in self.tokens.items():
            shards = m.shard_tokens(rid, tokens)
            assert all(0 <= t <= self.G for t in shards)
            assert len(shards) == len(self._needs(tokens)), "a shard too many or too few"
            assert [len(b) for b in m.block_table(rid)] == [math.ceil(t / self.bs) for t in shards]
            assert sum(shards) == tokens
        if not self.tokens:
            assert m.usage() == 0.0 and m.num_block_allocs == m.num_block_frees


KVMemoryMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVMemory = KVMemoryMachine.TestCase


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 8),
    groups=st.integers(1, 3),
    blocks=st.integers(4, 24),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=40),
)
def test_ensure_capacity_many_matches_one_by_one(block_size, groups, blocks, steps) -> None:
    gmax = block_size * max(1, blocks // 2)
    cache = CacheConfig(
        block_size=block_size, num_blocks_per_group=blocks, max_tokens_per_group=gmax, watermark=0.0
    )
    bulk, single = (KVBlockManager(cache, num_groups=groups) for _ in range(2))
    tokens: dict[str, int] = {}
    for i in range(4):
        rid = f"r{i}"
        if bulk.admit(rid, 1 + i):
            assert single.admit(rid, 1 + i)
            tokens[rid] = 1 + i
    for which, grow in steps:
        rid = f"r{which}"
        if rid not in tokens:
            continue
        want = tokens[rid] + grow
        failed = bulk.ensure_capacity_many([(rid, want)])
        ok = single.ensure_capacity(rid, want)
        assert (rid not in failed) == ok
        if ok:
            tokens[rid] = want
        assert bulk.block_table(rid) == single.block_table(rid)
        assert bulk.groups_of(rid) == single.groups_of(rid)
        assert bulk.pop_new_blocks(rid) == single.pop_new_blocks(rid)
        bulk.check_invariants()
