"""``ChunkSizer.adaptive_alone`` sizes a prefill turn's chunk as ``adaptive``
does on a fresh draft seeded with the lane's totals (one KVP group, one
shard): the same chunk, the same batch time (bit for bit), and, with the
caller's rule (the hint becomes the chunk once it is issued), the same hint.
"""

from __future__ import annotations

import random

import pytest

from medha_sched.batch_cost import BatchCost, chunk_works
from medha_sched.packer import Draft
from medha_sched.scheduler import Scheduler
from medha_sched.sim.runner import RunSpec
from tests.sched.mixed_queue import add_mixed_requests


@pytest.mark.parametrize("policy", ["lars-mp", "lars", "fcfs", "edf"])
def test_adaptive_alone_matches_adaptive_on_a_seeded_draft(policy: str) -> None:
    config, model, cache = RunSpec(
        policy=policy,
        cost_model="roofline:model=llama3-8b,gpu=a100",
        tp=8,
        spp=2,
        target_batch_time=0.05,
    ).build()
    sched = Scheduler(config, model, cache=cache)
    sizer = sched._sizer
    rng = random.Random(7)
    reqs = add_mixed_requests(sched, rng)
    fits = zero = seeded = 0
    for _ in range(3_000):
        r = rng.choice(reqs)
        rid = r.request_id
        start = rng.randrange(r.num_prefill_tokens)
        r.num_scheduled_tokens = start
        base = None
        if rng.random() < 0.7:  # the ready lane's decodes, summed as DecodeLanes.totals does
            feats = [
                model.features(1, rng.randint(1, 300_000), True) for _ in range(rng.randint(1, 60))
            ]
            base = [sum(col) for col in zip(*feats, strict=True)]
        hint = rng.choice([None, rng.randint(1, 16_384), 512, 2048])
        now = rng.uniform(0.0, 30.0)
        target = config.target_batch_time * rng.choice([1.0, 1.0, 0.5, 0.2])

        sizer.set_hint(rid, hint)
        draft = Draft(BatchCost(model, 1), target)
        if base is not None:
            draft.cost.seed([list(base)])
        base_time = draft.cost.time
        want, _ = sizer.adaptive(r, (0,), draft, now)
        want_hint = sizer.hint(rid)
        want_time = 0.0
        if want:
            draft.add(r, want, chunk_works((0,), start, want, sched.group_limit))
            want_time = draft.cost.time

        sizer.set_hint(rid, hint)
        got, got_time = sizer.adaptive_alone(
            r, model.group_time, model.features, base, base_time, target, now
        )
        assert (got, got_time) == (want, want_time)
        assert sizer.hint(rid) == hint  # left to the caller
        if got and start + got < r.num_prefill_tokens:
            assert want_hint == got  # the caller's set_hint(rid, chunk) after issuing
            fits += 1
        zero += not got
        seeded += base is not None and got > 0
    assert fits > 700 and zero > 50 and seeded > 400  # every path was taken
