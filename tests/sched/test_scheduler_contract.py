"""The scheduler/executor contract: results come back once, in order, validated."""

from __future__ import annotations

import pytest

from medha_sched import (
    AffineCostModel,
    BatchResult,
    ParallelDegrees,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
)


def make(spp: int = 1) -> Scheduler:
    model = AffineCostModel(
        base=1e-3, per_token=1e-5, per_attn=1e-9, layout=ParallelDegrees(spp=spp)
    )
    return Scheduler(SchedulerConfig(target_batch_time=0.05, max_chunk_tokens=64), model)


def test_a_rejected_result_leaves_the_batch_in_flight_for_a_retry() -> None:
    sched = make()
    sched.add_request(Request("a", 0.0, 10, 2))
    out = sched.schedule(0.0)
    with pytest.raises(SchedulerError, match="no sampled token for request 'a'"):
        sched.on_batch_end(out.batch_id, BatchResult())
    assert sched.num_in_flight_batches == 1
    assert sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids={"a": 5})) == ()
    assert sched.get_request("a").output_token_ids == [5]


def test_batches_must_end_in_the_order_they_were_scheduled() -> None:
    sched = make(spp=2)
    sched.add_request(Request("long", 0.0, 200, 1))
    first = sched.schedule(0.0)
    sched.on_stage_end(first.batch_id)
    second = sched.schedule(0.01)
    assert second.chunks and second.chunks[0].start == first.chunks[0].num_tokens
    with pytest.raises(SchedulerError, match=f"batch {second.batch_id} ended before batch"):
        sched.on_batch_end(second.batch_id, BatchResult())
    assert sched.on_batch_end(first.batch_id, BatchResult()) == ()


def test_schedule_output_is_frozen_plain_data() -> None:
    sched = make()
    sched.add_request(Request("a", 0.0, 10, 1))
    out = sched.schedule(0.0)
    with pytest.raises(AttributeError):
        out.predicted_time = 0.0  # type: ignore[misc]
    chunk = out.chunks[0]
    assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.kvp_groups) == ("a", 0, 10, (0,))
    assert chunk.samples and chunk.new_blocks and chunk.new_blocks[0][0] == 0
    with pytest.raises(AttributeError):
        chunk.start = 3  # type: ignore[misc]


def test_token_ids_travel_with_chunks_and_decodes() -> None:
    sched = make()
    sched.add_request(Request.from_tokens("a", 0.0, [11, 12, 13], max_output_tokens=3))
    out = sched.schedule(0.0)
    assert out.chunks[0].token_ids == (11, 12, 13)
    sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids={"a": 99}))
    decode = sched.schedule(0.1).chunks[0]
    assert (decode.start, decode.num_tokens, decode.token_ids) == (3, 1, (99,))


def test_prompt_token_ids_given_as_a_list_or_of_the_wrong_length() -> None:
    """``prompt_token_ids`` as a list (a tokenizer's output) was kept as given: with the
    prefix cache on, registering the decoded blocks joined a list slice with a tuple
    (TypeError inside ``on_batch_end``). Ids that disagree with ``num_prompt_tokens``
    were accepted and chunks went out with fewer ids than tokens."""
    from medha_sched import CacheConfig

    model = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
    cache = CacheConfig(block_size=4, num_blocks_per_group=64, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(target_batch_time=0.05), model, cache=cache)
    request = Request("a", 0.0, 10, 8, prompt_token_ids=list(range(10)))
    assert request.prompt_token_ids == tuple(range(10))
    sched.add_request(request)
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule(0.01 * steps)
        sampled = {c.request_id: 7 for c in out.chunks if c.samples}
        sched.on_batch_end(out.batch_id, BatchResult(sampled_token_ids=sampled))
        steps += 1
    assert request.output_token_ids == [7] * 8
    with pytest.raises(ValueError, match=r"prompt_token_ids holds 3 ids for num_prompt_tokens=10"):
        Request("b", 0.0, 10, 5, prompt_token_ids=(1, 2, 3))


@pytest.mark.parametrize("now", [float("nan"), float("inf"), float("-inf")])
def test_schedule_refuses_a_time_that_is_not_finite(now) -> None:
    """``schedule(nan)`` was taken: the clock became NaN, after which every
    "time went backwards" check passed (a comparison with NaN is False)."""
    sched = make()
    sched.add_request(Request("a", 0.0, 10, 2))
    with pytest.raises(SchedulerError, match=f"now must be a finite number of seconds, got {now}"):
        sched.schedule(now)
    sched.schedule(1.0)
    with pytest.raises(SchedulerError, match=r"time went backwards: now=0.5 < previous 1.0"):
        sched.schedule(0.5)


@pytest.mark.parametrize("bad", [None, "5", 2.5, True])
def test_a_token_that_is_not_an_integer_is_rejected_before_anything_changes(bad) -> None:
    """A None token (an executor that failed to sample) raised TypeError halfway through
    ``on_batch_end``: the batch was gone, the prompt counted as computed, no token
    recorded, and the request was never scheduled again. A decode's token was appended
    as given, unchecked."""
    sched = make()
    sched.add_request(Request("a", 0.0, 10, 3))
    prefill = sched.schedule(0.0)
    want = f"batch result's token for request 'a' must be an integer, got {bad!r}"
    with pytest.raises(SchedulerError, match=want):
        sched.on_batch_end(prefill.batch_id, BatchResult(sampled_token_ids={"a": bad}))
    assert sched.num_in_flight_batches == 1
    sched.on_batch_end(prefill.batch_id, BatchResult(sampled_token_ids={"a": 5}))
    decode = sched.schedule(0.1)
    assert [(c.start, c.num_tokens) for c in decode.chunks] == [(10, 1)]
    with pytest.raises(SchedulerError, match=want):
        sched.on_batch_end(decode.batch_id, BatchResult(sampled_token_ids={"a": bad}))
    sched.on_batch_end(decode.batch_id, BatchResult(sampled_token_ids={"a": 6}))
    assert sched.get_request("a").output_token_ids == [5, 6]
