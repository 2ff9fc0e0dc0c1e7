"""Async scheduling over KVP groups alone (one stage, no TP): every group samples each
step's tokens itself instead of waiting for group 0's broadcast. Every group's drawn
tokens must equal group 0's, greedy and seeded, and a decode issued ahead
(``PENDING_TOKEN``) must run on them; the non-sampling group then runs its last layer
whole and reports no rows. With TP, or sync, nothing changes."""

from __future__ import annotations

import pytest
import torch

from medha_runtime.plan import StepPlan
from medha_runtime.runner import ModelRunner, _replicated_sampling
from medha_runtime.sampling_params import SampleSpec
from medha_sched import PENDING_TOKEN
from tests.parallel.dist import launch
from tests.runtime.test_prepare_next import _decode_plans, _spec

SEEDED = SampleSpec("a", 0.9, 0, 0.95, 1234, None)


def _ahead(plans: list[StepPlan], sample: SampleSpec) -> list[StepPlan]:
    """``plans`` with ``sample`` on every sampled chunk and each decode's token id
    ``PENDING_TOKEN`` (issued ahead: the runner takes the token the step before drew)."""
    out = []
    for i, p in enumerate(plans):
        chunks = []
        for c in p.chunks:
            c = c._replace(sample=sample) if c.sample is not None else c
            if i and len(c.token_ids) == 1:  # a decode: the step before sampled its token
                c = c._replace(token_ids=(PENDING_TOKEN,))
            chunks.append(c)
        out.append(StepPlan(p.step_id, tuple(chunks)))
    return out


def _ranks(rank: int, world: int, init: str, temperature: float) -> dict[str, object]:
    """Each step's result and the token this rank keeps for its next decode."""
    from medha_parallel import ParallelLayout, ParallelState

    torch.set_num_threads(1)
    state = ParallelState.initialize(
        ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
    )
    spec = _spec(num_blocks=8, kvp=2, group_tokens=16, pending_tokens=True)
    sample = SEEDED if temperature else SEEDED._replace(temperature=0.0)
    plans = _ahead(_decode_plans("a", 21, 9, kvp=2, group_tokens=16), sample)
    runner = ModelRunner(spec, state)
    kept, reported = [], []
    for p in plans:
        result = runner.execute(p)
        reported.append(None if result is None else [s.token_id for s in result])
        kept.append(runner._last_token.get("a"))  # type: ignore[union-attr]
    return {
        "kept": kept,
        "reported": reported,
        "broadcast": runner._tokens is not None,
        "drop_layer": runner._drop_layer,
        "sampler": runner.is_sampler,
    }


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_every_kvp_group_draws_the_sampler_s_tokens(temperature: float) -> None:
    r0, r1 = launch(_ranks, 2, temperature)
    assert r0["sampler"] and not r1["sampler"]
    assert not r0["broadcast"] and not r1["broadcast"]  # no broadcast built, none awaited
    assert r0["drop_layer"] is None and r1["drop_layer"] is None  # group 1 runs it whole
    steps = len(r0["kept"])
    assert steps == 10  # the prefill's two chunks (one per shard) and 8 decodes
    # group 0 reports each sampled step's token; group 1 reports none
    drawn = [t[0] for t in r0["reported"] if t]
    assert len(drawn) == steps - 1  # the first chunk samples nothing
    assert all(t is None for t in r1["reported"])
    # and both keep the same token for the next decode: group 0's
    assert r1["kept"][1:] == r0["kept"][1:] == drawn
    if temperature:  # the seeded draw is not the arg-max throughout (a real draw)
        greedy = launch(_ranks, 2, 0.0)[0]["kept"]
        assert greedy[1:] != drawn


def test_replicated_sampling_only_with_async_kvp_alone() -> None:
    kw = {"num_blocks": 8, "group_tokens": 16}
    assert _replicated_sampling(_spec(kvp=2, pending_tokens=True, **kw))
    assert not _replicated_sampling(_spec(kvp=2, pending_tokens=False, **kw))
    assert not _replicated_sampling(_spec(kvp=2, tp=2, pending_tokens=True, **kw))
    assert not _replicated_sampling(_spec(kvp=2, spp=2, pending_tokens=True, **kw))
    assert not _replicated_sampling(_spec(pending_tokens=True, num_blocks=8))
