"""A KVP group that does not sample (one stage) stops its last layer after the attention:
the layer writes its K/V and hands its partial state to the sampler's merge
(``KVPCommunicator.contributor``, no wait for the other state), then the step ends
(``LlamaModel.forward(output=False)``). The sampler's logits are bit for bit those of
ranks whose every layer runs whole, and the non-sampling rank's KV cache the same; with
tp = 2 both tensor-parallel ranks of the non-sampling group stop (their last layer's
all-reduces skipped together), and every rank's KV cache is the same."""

from __future__ import annotations

import pytest
import torch

from medha_runtime import runner as runner_mod
from medha_runtime.model import llama
from medha_runtime.runner import ModelRunner
from tests.parallel.dist import launch
from tests.runtime.test_prepare_next import _decode_plans, _spec


def _ranks(rank: int, world: int, init: str, tp: int = 1) -> dict[str, object]:
    """The same steps on runners as built and on runners whose last layer runs whole
    (``_drop_layer`` None): the sampled logits (rank 0), the KV cache, and per step the
    layers run whole, run to their attention only and contributions made."""
    from medha_parallel import ParallelLayout, ParallelState

    torch.set_num_threads(1)
    state = ParallelState.initialize(
        ParallelLayout(tp=tp, kvp=world // tp),
        init_method=init,
        rank=rank,
        world_size=world,
        device="cpu",
    )
    spec = _spec(num_blocks=8, tp=tp, kvp=2, group_tokens=16)
    plans = _decode_plans("a", 21, 8, kvp=2, group_tokens=16)  # prefill of 21, decodes 21..27
    seen: list[torch.Tensor] = []
    calls: list[str] = []
    sample_step = runner_mod.sample_step
    Layer = llama.LlamaDecoderLayer
    forward, kv_only = Layer.forward, Layer.forward_kv_only

    def keep(sampler, logits, chunks):
        seen.append(logits.clone())
        return sample_step(sampler, logits, chunks)

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    runner_mod.sample_step = keep
    Layer.forward = counted("whole", forward)
    Layer.forward_kv_only = counted("kv only", kv_only)
    out: dict[str, object] = {}
    try:
        for name in ("drop", "whole"):
            runner = ModelRunner(spec, state)
            if name == "whole":
                runner._drop_layer = None
            comm = runner.attention.comm
            contributor = comm.contributor

            def contributor_counted(*args, _get=contributor, **kwargs):
                fn = _get(*args, **kwargs)
                return None if fn is None else counted("contribute", fn)

            comm.contributor = contributor_counted
            seen.clear()
            per_step = []
            for p in plans:
                calls.clear()
                runner.execute(p)
                per_step.append(tuple(calls.count(c) for c in ("whole", "kv only", "contribute")))
            kv = [t.clone() for t in (*runner.kv.k, *runner.kv.v)]
            out[name] = (list(seen), per_step, kv, runner._drop_layer, runner.sampler is not None)
    finally:
        runner_mod.sample_step = sample_step
        Layer.forward, Layer.forward_kv_only = forward, kv_only
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_the_non_sampling_group_stops_after_its_last_attention(tp: int) -> None:
    results = launch(_ranks, 2 * tp, tp)
    layers, steps = 4, 9  # tiny; the prefill's two chunks and 7 decodes
    samplers = [r for r in results if r["drop"][4]]
    assert len(samplers) == 1
    dropping = [r for r in results if r["drop"][3] is not None]
    assert len(dropping) == tp  # the non-sampling group's ranks, every one of them
    assert all(r["drop"][3] == layers - 1 for r in dropping)
    for r in results:
        assert r["whole"][1] == [(layers, 0, 0)] * steps
        if r["drop"][3] is None:  # the sampling group runs every layer whole
            assert r["drop"][1] == [(layers, 0, 0)] * steps
            continue
        # the last layer to its attention only; it contributes from the second step
        # (the first one's merge resolves the shared-memory path for those shapes; the
        # prefill's second chunk has other shapes than the decodes' first one)
        got = r["drop"][1]
        assert all(whole == layers - 1 and only == 1 for whole, only, _ in got), got
        assert [c for *_, c in got][2:] == [1] * (steps - 2), got
    # the sampler's logits bit for bit; every rank's KV cache (the last layer's K/V written)
    (sampler,) = samplers
    fast, whole = sampler["drop"][0], sampler["whole"][0]
    assert len(fast) == len(whole) == steps
    for a, b in zip(fast, whole, strict=True):
        assert torch.equal(a, b)
    for r in results:
        for a, b in zip(r["drop"][2], r["whole"][2], strict=True):
            assert torch.equal(a, b)
        if r is not sampler:
            assert r["drop"][0] == [] and r["whole"][0] == []
