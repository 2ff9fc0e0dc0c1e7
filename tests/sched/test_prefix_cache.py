"""Prefix caching in medha_sched: the shared block pool, and the scheduler on top.

Unit cases, a stateful hypothesis test of the KV manager with sharing (the
shadow model tracks which token prefix every block's KV belongs to), and the
scheduler's invariants with shared prefixes (``harness.run``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from medha_sched import AffineCostModel, BatchResult, ParallelDegrees, Request, Scheduler
from medha_sched.config import CacheConfig, SchedulerConfig
from medha_sched.kv_memory import KVBlockManager
from medha_sched.prefix_hash import extend_token_hashes

from .harness import run
from .strategies import setups, workloads


def make(bs=4, blocks=10, g_blocks=4, groups=3, wm=0.0) -> KVBlockManager:
    cache = CacheConfig(
        block_size=bs,
        num_blocks_per_group=blocks,
        max_tokens_per_group=bs * g_blocks,
        watermark=wm,
        enable_prefix_caching=True,
    )
    return KVBlockManager(cache, num_groups=groups)


def hashes(tokens, bs=4) -> list:
    out: list = []
    extend_token_hashes(out, tokens, bs)
    return out


def admit_and_compute(m: KVBlockManager, rid, tokens) -> None:
    assert m.admit(rid, len(tokens), hashes(tokens))
    m.register_blocks(rid, hashes(tokens), len(tokens))


# ---------------------------------------------------------------------- unit tests
def test_block_hashes_name_the_whole_prefix_and_are_the_same_in_every_process():
    import hashlib
    import struct

    doc = list(range(100, 112))
    h = hashes(doc)
    assert len(h) == 3 and len(set(h)) == 3  # whole blocks only (12 tokens, bs 4)
    assert hashes(doc[:11]) == h[:2]  # a partial last block is left out
    first = hashlib.blake2b(struct.pack("<4q", 100, 101, 102, 103), digest_size=16).digest()
    assert h[0] == first  # no per-process salt: a server's ranks and restarts agree
    changed = hashes([99, *doc[1:]])
    assert all(a != b for a, b in zip(changed, h, strict=True))  # block 0 changes all after it
    more: list = h[:1]
    extend_token_hashes(more, doc[4:], 4)  # extending from a block boundary continues the chain
    assert more == h


def test_a_shared_prefix_is_shared_not_copied_and_the_last_token_is_computed():
    m = make()
    doc = list(range(100, 112))  # 3 blocks
    admit_and_compute(m, "a", doc)
    assert m.cached_tokens("a") == 0
    # identical prompt: the hit stops one token short (2 blocks, not 3)
    assert m.admit("b", 12, hashes(doc))
    assert m.cached_tokens("b") == 8
    a, b = m.block_table("a"), m.block_table("b")
    assert b[0][:2] == a[0][:2] and b[0][2] != a[0][2]
    assert m.ref_count(0, a[0][0]) == 2
    # a longer prompt on the same document hits all three blocks
    assert m.admit("c", 14, hashes([*doc, 1, 2]))
    assert m.cached_tokens("c") == 12
    assert m.pop_new_blocks("c") == ((0, (*a[0][:3], m.block_table("c")[0][3])),)
    m.check_invariants()
    for rid in "abc":
        m.free(rid)
    assert m.usage() == 0.0 and m.num_cached_blocks(0) == 3
    m.check_invariants()


def test_a_different_token_breaks_the_chain():
    m = make()
    admit_and_compute(m, "a", list(range(12)))
    other = [*range(4), 99, *range(5, 12), 7]
    assert m.admit("b", 13, hashes(other))
    assert m.cached_tokens("b") == 4  # only the first block agrees


def test_unreferenced_cached_blocks_are_evicted_lru_only_when_needed():
    m = make(blocks=6, g_blocks=6, groups=1)
    first, second = list(range(8)), list(range(50, 58))
    admit_and_compute(m, "a", first)
    admit_and_compute(m, "b", second)
    m.free("a")
    m.free("b")  # 4 cached blocks, 2 free
    assert m.num_free_blocks(0) == 6 and m.num_cached_blocks(0) == 4
    assert m.admit("c", 8)  # takes the 2 free blocks: nothing evicted
    assert m.num_cached_blocks(0) == 4
    assert m.admit("d", 4)  # evicts the least recently released block: a's last
    assert m.num_cached_blocks(0) == 3
    # a request's blocks go back last first: its prefix is evicted from the end
    assert m.cached_prefix_tokens(hashes([*first, 0]), 9) == 4
    assert m.cached_prefix_tokens(hashes([*second, 0]), 9) == 8
    m.check_invariants()


def test_a_prefix_crossing_a_kvp_shard_maps_to_the_same_groups():
    m = make(blocks=10, g_blocks=2, groups=3)  # G = 8 tokens: shards of 2 blocks
    admit_and_compute(m, "filler", list(range(500, 508)))  # makes group 0 the fullest
    doc = list(range(20))  # shards 8 + 8 + 4
    admit_and_compute(m, "a", doc)
    groups = m.groups_of("a")
    assert m.admit("b", 22, hashes([*doc, 1, 2]))
    assert m.cached_tokens("b") == 20
    assert m.groups_of("b") == groups  # each shard on the group holding its KV
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    m.check_invariants()


def test_preemption_frees_references_not_shared_blocks():
    m = make()
    doc = list(range(12))
    admit_and_compute(m, "a", doc)
    assert m.admit("b", 13, hashes([*doc, 5]))
    shared = m.block_table("b")[0][:3]
    m.free("b")  # preempted: a still holds the shared blocks
    assert all(m.ref_count(0, blk) == 1 for blk in shared)
    assert m.admit("b", 13, hashes([*doc, 5])) and m.block_table("b")[0][:3] == shared


def test_caching_off_ignores_hashes():
    cache = CacheConfig(block_size=4, num_blocks_per_group=10, max_tokens_per_group=16)
    m = KVBlockManager(cache, num_groups=1)
    doc = list(range(12))
    assert m.admit("a", 12, hashes(doc))
    m.register_blocks("a", hashes(doc), 12)
    assert m.admit("b", 13, hashes([*doc, 1])) and m.cached_tokens("b") == 0


# ------------------------------------------------------------- stateful property
class SharedPool(RuleBasedStateMachine):
    """Requests over a few shared token streams; the shadow records, for every
    held or cached block, the token prefix its KV was computed for."""

    @initialize(groups=st.integers(1, 3), blocks=st.integers(6, 16), data=st.data())
    def setup(self, groups, blocks, data):
        self.bs = 2
        g_blocks = data.draw(st.integers(2, blocks - 1), label="g_blocks")
        self.m = make(bs=self.bs, blocks=blocks, g_blocks=g_blocks, groups=groups)
        self.G = self.bs * g_blocks
        self.streams = [[s * 1000 + i for i in range(self.G * groups)] for s in range(3)]
        self.live: dict[int, list[int]] = {}  # request -> its tokens
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}  # (group, block) -> prefix
        self.next_id = 0

    def _blocks(self, rid):
        for shard, (g, blocks) in enumerate(
            zip(self.m.groups_of(rid), self.m.block_table(rid), strict=True)
        ):
            for i, b in enumerate(blocks):
                yield shard * (self.G // self.bs) + i, g, b

    def _held(self) -> set[tuple[int, int]]:
        return {(g, b) for rid in self.live for _, g, b in self._blocks(rid)}

    @rule(data=st.data())
    def admit(self, data):
        stream = data.draw(st.sampled_from(self.streams), label="stream")
        n = data.draw(st.integers(1, len(stream)), label="prefix")
        tokens = stream[:n] + [data.draw(st.integers(1, 9), label="tail")] * data.draw(
            st.integers(0, 3)
        )
        tokens = tokens[: len(stream)]
        held_before = self._held()
        rid, self.next_id = self.next_id, self.next_id + 1
        if not self.m.admit(rid, len(tokens), hashes(tokens, self.bs)):
            return
        self.live[rid] = tokens
        cached = self.m.cached_tokens(rid)
        assert cached < len(tokens), "the last prompt token must be computed"
        for k, g, b in self._blocks(rid):
            if k * self.bs < cached:  # a hit: its KV is exactly this prefix's
                assert self.content[(g, b)] == tuple(tokens[: (k + 1) * self.bs])
            else:  # a new block: never one somebody else holds (eviction or not)
                assert (g, b) not in held_before, f"block {(g, b)} handed out while held"
                self.content.pop((g, b), None)

    @rule(data=st.data())
    def decode(self, data):
        # a running request grows by decoded tokens (few values, so requests
        # often decode the same continuation and share its blocks later)
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        tokens = self.live[rid]
        grown = tokens + data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=5))
        grown = grown[: len(self.streams[0])]
        held_before = self._held()
        had = set(self._blocks(rid))
        if not self.m.ensure_capacity(rid, len(grown)):
            return
        self.live[rid] = grown
        for k, g, b in self._blocks(rid):
            if (k, g, b) not in had:  # a new block: never one somebody else holds
                assert (g, b) not in held_before, f"block {(g, b)} handed out while held"
                self.content.pop((g, b), None)

    @rule(data=st.data())
    def compute(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        tokens = self.live[rid]
        upto = data.draw(st.integers(0, len(tokens)), label="upto")
        self.m.register_blocks(rid, hashes(tokens, self.bs), upto)
        for k, g, b in self._blocks(rid):
            if (k + 1) * self.bs <= upto and self.m._pools[g].hash_of(b) is not None:
                self.content.setdefault((g, b), tuple(tokens[: (k + 1) * self.bs]))

    @rule(data=st.data())
    def free(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        self.m.free(rid)
        del self.live[rid]

    @rule()
    def everyone_ends(self):
        for rid in list(self.live):
            self.m.free(rid)
        self.live.clear()
        assert self.m.usage() == 0.0, "usage must return to zero when every request ends"

    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()  # refcounts >= 1, free/held/cached disjoint, hash maps agree
        holders: dict[tuple[int, int], int] = {}
        for rid in self.live:
            for _, g, b in self._blocks(rid):
                holders[(g, b)] = holders.get((g, b), 0) + 1
        for (g, b), n in holders.items():
            assert self.m.ref_count(g, b) == n, "a referenced block lost a reference"
        for g, pool in enumerate(self.m._pools):
            live_hashes = [pool.hash_of(b) for b in range(pool.num_blocks)]
            named = [h for h in live_hashes if h is not None]
            assert len(named) == len(set(named)), f"group {g}: a hash names two blocks"


SharedPool.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSharedPool = SharedPool.TestCase


# ------------------------------------------------------------------ scheduler
def _sched(*, aware: bool = True, kvp: int = 1) -> Scheduler:
    model = AffineCostModel(
        base=1e-3, per_token=1e-5, per_attn=1e-8, layout=ParallelDegrees(kvp=kvp)
    )
    cache = CacheConfig(
        block_size=4,
        num_blocks_per_group=400,
        max_tokens_per_group=256,
        enable_prefix_caching=True,
    )
    config = SchedulerConfig(
        target_batch_time=0.05, max_chunk_tokens=256, min_deadline=0.0, cache_aware_slack=aware
    )
    return Scheduler(config, model, cache=cache)


def _finish_all(sched: Scheduler, now: float = 0.0) -> None:
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        now += 0.01
        sampled = {c.request_id: 1 for c in out.chunks if c.samples}
        sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))


def test_a_new_request_starts_with_its_cached_prefix_computed():
    sched = _sched()
    doc = list(range(1, 201))
    sched.add_request(Request.from_tokens("a", 0.0, doc, max_output_tokens=2))
    _finish_all(sched)
    b = Request.from_tokens("b", 1.0, [*doc, 7, 8, 9], max_output_tokens=2)
    fresh = Request.from_tokens("c", 1.0, list(range(1000, 1203)), max_output_tokens=2)
    sched.add_request(b)
    sched.add_request(fresh)
    assert b.remaining_work < fresh.remaining_work / 5  # priced by its uncached tokens
    assert b.deadline < fresh.deadline
    out = sched.schedule(2.0)
    chunk = next(c for c in out.prefill_chunks if c.request_id == "b")
    assert (chunk.start, chunk.num_tokens) == (200, 3) and chunk.samples
    assert b.num_cached_tokens == 200 and b.num_computed_tokens == 200
    assert sum(len(ids) for _, ids in chunk.new_blocks) == 51  # 50 shared + 1 new
    assert sched.prefix_cache_hits == 200 and sched.prefix_cache_queries == 200 + 203 + 203
    sched.on_batch_end(
        out.batch_id, BatchResult({c.request_id: 1 for c in out.chunks if c.samples})
    )
    _finish_all(sched, 3.0)
    assert sched.memory.usage() == 0.0


def test_a_request_that_opts_out_of_the_lookup_is_not_counted_as_a_query():
    # prompt logprobs need every position computed: such a request is not looked
    # up, so it is no query (vLLM's counters skip it too): the hit rate is of lookups
    sched = _sched()
    doc = list(range(1, 201))
    sched.add_request(Request.from_tokens("a", 0.0, doc, max_output_tokens=2))
    _finish_all(sched)
    sched.add_request(
        Request.from_tokens("b", 1.0, [*doc, 7], max_output_tokens=2, prefix_caching=False)
    )
    _finish_all(sched, 2.0)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (200, 0)
    sched.add_request(Request.from_tokens("c", 3.0, [*doc, 8], max_output_tokens=2))
    _finish_all(sched, 4.0)
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (200 + 201, 200)


def test_length_based_slack_prices_the_whole_prompt():
    aware, naive = _sched(aware=True), _sched(aware=False)
    doc = list(range(1, 201))
    for sched in (aware, naive):
        sched.add_request(Request.from_tokens("a", 0.0, doc, max_output_tokens=1))
        _finish_all(sched)
        sched.add_request(Request.from_tokens("b", 1.0, [*doc, 5], max_output_tokens=1))
    assert aware.get_request("b").remaining_work < naive.get_request("b").remaining_work
    for sched in (aware, naive):  # both reuse the KV all the same
        out = sched.schedule(2.0)
        assert out.prefill_chunks[0].start == 200


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_scheduler_invariants_hold_with_shared_prefixes(data) -> None:
    sched = data.draw(setups(prefix_caching=True))
    requests = data.draw(workloads(sched, shared_prefixes=True))
    trace = run(sched, requests)
    assert set(trace.finished) == {r.request_id for r in requests}
    assert sched.memory.usage() == 0.0
    sched.memory.check_invariants()


@SETTINGS
@given(data=st.data())
def test_preemption_under_tight_memory_with_shared_prefixes(data) -> None:
    sched = data.draw(setups(adaptive=True, tight_memory=True, prefix_caching=True))
    requests = data.draw(workloads(sched, heavy=True, shared_prefixes=True))
    trace = run(sched, requests)
    assert set(trace.finished) == {r.request_id for r in requests}
    assert sched.memory.usage() == 0.0
