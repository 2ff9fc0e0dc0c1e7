"""``cache_salt`` (vLLM's): a salt mixed into a prompt's first block hash, so a
request only hits cached blocks computed by requests with the same salt."""

from __future__ import annotations

import pytest

from medha_sched import AffineCostModel, BatchResult, ParallelDegrees, Request, Scheduler
from medha_sched.config import CacheConfig, SchedulerConfig
from medha_sched.prefix_hash import extend_stream_hashes, extend_token_hashes


def hashes(tokens, salt=None, bs=4) -> list:
    out: list = []
    extend_token_hashes(out, tokens, bs, salt=salt)
    return out


def _sched(*, caching: bool = True, kvp: int = 1) -> Scheduler:
    layout = ParallelDegrees(kvp=kvp)
    model = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-8, layout=layout)
    cache = CacheConfig(
        block_size=4,
        num_blocks_per_group=400,
        max_tokens_per_group=256,
        enable_prefix_caching=caching,
    )
    config = SchedulerConfig(target_batch_time=0.05, max_chunk_tokens=256, min_deadline=0.0)
    return Scheduler(config, model, cache=cache)


def _finish_all(sched, now: float) -> None:
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        now += 0.01
        sampled = {c.request_id: 1 for c in out.chunks if c.samples}
        sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))


def test_a_salt_changes_every_block_hash_and_only_its_own_salt_agrees():
    doc = list(range(100, 112))
    plain, a, b = hashes(doc), hashes(doc, "tenant-a"), hashes(doc, "tenant-b")
    assert len(a) == len(b) == 3
    assert not set(a) & set(plain) and not set(a) & set(b)  # every block differs
    assert hashes(doc, "tenant-a") == a  # deterministic: ranks and restarts agree
    more = a[:1]
    extend_token_hashes(more, doc[4:], 4, salt="tenant-a")  # the salt only seeds block 0
    assert more == a
    assert hashes(doc, "\ud800") != plain  # a lone surrogate (JSON allows it) still hashes


def test_stream_hashes_take_the_salt_too():
    plain: list = []
    salted: list = []
    extend_stream_hashes(plain, "doc", 3)
    extend_stream_hashes(salted, "doc", 3, salt="t")
    assert not set(plain) & set(salted)


@pytest.mark.parametrize("salt", ["", 7, b"x"])
def test_a_request_refuses_an_empty_or_non_string_salt(salt):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        Request.from_tokens("a", 0.0, [1, 2, 3], max_output_tokens=1, cache_salt=salt)


def _cached_after(sched, rid: str, salt, now: float, doc) -> int:
    request = Request.from_tokens(rid, now, [*doc, 7], max_output_tokens=1, cache_salt=salt)
    sched.add_request(request)
    _finish_all(sched, now)
    return request.num_cached_tokens


def test_requests_share_cached_prefixes_only_with_their_own_salt():
    sched = _sched()
    doc = list(range(1, 201))
    assert _cached_after(sched, "a1", "a", 0.0, doc) == 0
    assert _cached_after(sched, "b1", "b", 1.0, doc) == 0  # another salt: nothing shared
    assert _cached_after(sched, "n1", None, 2.0, doc) == 0  # no salt: not the salted blocks
    assert _cached_after(sched, "a2", "a", 3.0, doc) == 200
    assert _cached_after(sched, "b2", "b", 4.0, doc) == 200
    assert _cached_after(sched, "n2", None, 5.0, doc) == 200  # unsalted share as before
    assert sched.memory.usage() == 0.0


def test_without_prefix_caching_a_salt_is_accepted_and_changes_nothing():
    sched = _sched(caching=False)
    doc = list(range(1, 201))
    assert _cached_after(sched, "a1", "a", 0.0, doc) == 0
    assert _cached_after(sched, "a2", "a", 1.0, doc) == 0
    assert sched.memory.usage() == 0.0


def test_a_salted_prefix_across_kvp_shards_is_shared_only_with_its_salt():
    sched = _sched(kvp=2)  # shards of 256 tokens: the document spans two
    doc = list(range(1, 301))
    assert _cached_after(sched, "a1", "a", 0.0, doc) == 0
    assert _cached_after(sched, "b1", "b", 1.0, doc) == 0
    assert _cached_after(sched, "a2", "a", 2.0, doc) == 300  # both shards hit
    assert _cached_after(sched, "n1", None, 3.0, doc) == 0
