"""Decode steps on padded static batches (CUDA graphs on a GPU; eagerly on a CPU).

On the CPU the padded batches run without capture: these tests check the
padding rows, the scratch block, the static buffers and the batch sizes
against the plain path, token for token. The CUDA test captures and replays.
"""

from __future__ import annotations

import pytest
import torch

from medha_runtime import LLM, SamplingParams
from medha_runtime.config import EngineConfig
from medha_runtime.decode_graphs import KV_BUCKET_MIN, graph_sizes, kv_bucket
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.sampling_params import PromptLogprobSpec, SampleSpec

CUDA = torch.cuda.is_available()


def test_graph_sizes_cover_every_batch_with_little_padding() -> None:
    assert graph_sizes(1) == (1,)
    assert graph_sizes(3) == (1, 2, 4)
    assert graph_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    for top in (1, 5, 8, 9, 63, 100, 256):
        sizes = graph_sizes(top)
        assert sizes[-1] >= top and list(sizes) == sorted(set(sizes))
        for b in range(1, top + 1):
            padded = next(s for s in sizes if s >= b)
            assert padded - b < max(8, b)  # never more than double, at most 7 rows past 8
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        graph_sizes(0)


def test_kv_bounds_double_from_the_fewest_keys_per_split_up_to_the_context() -> None:
    assert KV_BUCKET_MIN == 128
    assert [kv_bucket(n, 4096) for n in (1, 128, 129, 256, 257, 3000, 4096)] == [
        128, 128, 256, 256, 512, 4096, 4096,
    ]  # fmt: skip
    assert kv_bucket(600, 600) == 600 and kv_bucket(100, 600) == 128
    for bad in (0, 4097):
        with pytest.raises(ValueError, match=rf"max_kv must be in \[1, 4096\], got {bad}"):
            kv_bucket(bad, 4096)


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [5 + i, 9, 11, 40 + i] * (1 + i % 3)} for i in range(n)]


def _generate(llm: LLM, params: list[SamplingParams]) -> list:
    outs = llm.generate(_prompts(len(params)), params)
    return [o.outputs[0] for o in outs]


def _staggered(n: int, **kw) -> list[SamplingParams]:
    """Requests that stop at different steps: the decode batch shrinks through the sizes."""
    return [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True, **kw) for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_decodes_give_the_plain_tokens(async_scheduling: bool) -> None:
    kw = {"dtype": "float32", "device": "cpu", "async_scheduling": async_scheduling}
    plain = LLM("tiny", **kw)
    padded = LLM("tiny", cuda_graphs=True, **kw)
    for params in (
        _staggered(11, temperature=0.0),
        _staggered(11, temperature=0.9, seed=7),
        _staggered(5, temperature=0.0, logprobs=3),
    ):
        want = _generate(plain, params)
        got = _generate(padded, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        if params[0].logprobs:
            for g, w in zip(got, want, strict=True):
                assert [sorted(d) for d in g.logprobs] == [sorted(d) for d in w.logprobs]
    graphs = padded.engine.executor.runner.graphs
    assert graphs is not None and graphs.off is None and not graphs.capture
    assert {1, 2, 4, 8, 16} <= set(graphs._static)  # 11 shrinking to 1 used every size
    assert plain.engine.executor.runner.graphs is None  # auto on a CPU: off
    plain.shutdown()
    padded.shutdown()


def test_fits_only_decode_only_steps() -> None:
    llm = LLM("tiny", dtype="float32", device="cpu", cuda_graphs=True, max_batch_requests=4)
    graphs = llm.engine.executor.runner.graphs
    assert graphs.sizes == (1, 2, 4)

    def spec(rid: str) -> SampleSpec:  # greedy (as profile.py builds one)
        return SampleSpec(rid, 0.0, 0, 1.0, 0, None)

    def decode(i: int, **kw) -> PlannedChunk:
        return PlannedChunk(f"r{i}", 7, (3,), (0,), sample=spec(f"r{i}"), **kw)

    assert graphs.fits(StepPlan(1, tuple(decode(i) for i in range(4))))
    assert not graphs.fits(StepPlan(1, tuple(decode(i) for i in range(5))))  # over the sizes
    assert not graphs.fits(StepPlan(1, ()))
    prefill = PlannedChunk("p", 0, (3, 4), (0,), sample=spec("p"))
    assert not graphs.fits(StepPlan(1, (decode(0), prefill)))
    logprobs = PromptLogprobSpec(top=1, targets=(4,))
    assert not graphs.fits(StepPlan(1, (decode(0, prompt_logprobs=logprobs),)))
    no_sample = PlannedChunk("n", 7, (3,), (0,))
    assert not graphs.fits(StepPlan(1, (no_sample,)))
    llm.shutdown()


def test_config_refuses_bad_cuda_graphs() -> None:
    with pytest.raises(ValueError, match=r"cuda_graphs must be True, False or None .*'yes'"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs one rank .* got tp=2"):
        EngineConfig(cuda_graphs=True, tp=2)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graph_replays_give_the_eager_tokens() -> None:
    kw = {"dtype": "bfloat16", "device": "cuda", "attention_backend": "triton"}
    eager = LLM("tiny", cuda_graphs=False, **kw)
    graphed = LLM("tiny", **kw)  # on by default with CUDA and one rank
    params = _staggered(11, temperature=0.0)
    want = _generate(eager, params)
    got = _generate(graphed, params)
    graphs = graphed.engine.executor.runner.graphs
    assert eager.engine.executor.runner.graphs is None
    assert graphs is not None and graphs.off is None, graphs and graphs.off
    assert graphs.capture and graphs.replays > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # rows past 128 and 256 keys: the same sizes get graphs for larger KV bounds
    long = [{"prompt_token_ids": [7 + i % 50 for i in range(300 + j)]} for j in range(3)]
    p = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    want = [o.outputs[0].token_ids for o in eager.generate(long, p)]
    got = [o.outputs[0].token_ids for o in graphed.generate(long, p)]
    assert got == want
    assert any(len(st.graphs) >= 2 for st in graphs._static.values())
    assert not any(st.failed for st in graphs._static.values())
    eager.shutdown()
    graphed.shutdown()
