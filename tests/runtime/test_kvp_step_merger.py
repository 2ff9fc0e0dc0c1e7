"""A KVP rank's later layers merge through ``KVPCommunicator.merger`` and attend through
``PagedAttentionPlan.unchecked_run`` (both resolved by the step's first layer): one
``merge`` call a step, the same logits bit for bit as a rank whose every layer goes
through ``merge`` and the checked ``run``."""

from __future__ import annotations

import torch

from medha_kernels import PagedAttentionPlan
from medha_runtime import runner as runner_mod
from medha_runtime.runner import ModelRunner
from tests.parallel.dist import launch
from tests.runtime.test_prepare_next import _decode_plans, _spec


class _NeverKept(dict):
    """A ``KVPCommunicator._fast`` that keeps nothing: every merge takes the checked path."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


def _ranks(rank: int, world: int, init: str) -> dict[str, object]:
    """The same steps on a runner as built and on one whose communicator never finds a
    merger and whose attention plans hand out their checked ``run``: the sampled logits
    (rank 0) and the ``merge`` calls per step."""
    from medha_parallel import ParallelLayout, ParallelState

    torch.set_num_threads(1)
    state = ParallelState.initialize(
        ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
    )
    spec = _spec(num_blocks=8, kvp=2, group_tokens=16)
    plans = _decode_plans("a", 21, 8, kvp=2, group_tokens=16)  # prefill of 21, decodes 21..27
    seen: list[torch.Tensor] = []
    sample_step, unchecked_run = runner_mod.sample_step, PagedAttentionPlan.unchecked_run

    def keep(sampler, logits, chunks):
        seen.append(logits.clone())
        return sample_step(sampler, logits, chunks)

    runner_mod.sample_step = keep
    out: dict[str, object] = {}
    try:
        for name in ("fast", "checked"):
            runner = ModelRunner(spec, state)
            comm = runner.attention.comm
            merge, calls = comm.merge, []

            def counted(*args, _merge=merge, _calls=calls, **kwargs):
                _calls.append(1)
                return _merge(*args, **kwargs)

            comm.merge = counted
            if name == "checked":  # every layer's merge and attention checked
                comm.merger = lambda *args, **kwargs: None
                comm._fast = _NeverKept()  # merge itself never takes the closure either
                comm._publish = _NeverKept()  # nor the last layer of rank 1 its contributor
                PagedAttentionPlan.unchecked_run = lambda plan: plan.run
            seen.clear()
            per_step = []
            for p in plans:
                calls.clear()
                runner.execute(p)
                per_step.append(len(calls))
            out[name] = (list(seen), per_step, comm.uses_shared_memory)
    finally:
        runner_mod.sample_step = sample_step
        PagedAttentionPlan.unchecked_run = unchecked_run
    return out


def test_later_layers_merge_through_the_merger_with_the_same_logits() -> None:
    r0, r1 = launch(_ranks, 2)
    layers = 4  # tiny
    for res in (r0, r1):
        fast_calls, checked_calls = res["fast"][1], res["checked"][1]
        assert checked_calls == [layers] * len(checked_calls)  # every layer through merge
        assert res["fast"][2] and res["checked"][2]  # the shared-memory merge
        # the prefill (two shards: a prefill chunk on each) and every decode: the first
        # layer through merge, the rest through the merger it found
        assert fast_calls == [1] * len(fast_calls), fast_calls
    fast, checked = r0["fast"][0], r0["checked"][0]
    # one per step: the prefill's first chunk samples nothing ([0, vocab]), the rest a row
    assert len(fast) == len(checked) == 9
    assert [len(t) for t in fast] == [0] + [1] * 8
    for a, b in zip(fast, checked, strict=True):
        assert torch.equal(a, b)
    assert r1["fast"][0] == [] and r1["checked"][0] == []  # rank 1 samples nothing
