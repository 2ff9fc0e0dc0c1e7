"""Sampling: parameter validation, the Sampler, and sampling through ``LLM`` on tiny."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_runtime import LLM, SamplingParams
from medha_runtime.model import ForwardBatch, load_model
from medha_runtime.model.tiny import tiny_tokenizer
from medha_runtime.sampling import Penalties, Sampler, SampleSpec, greedy_argmax
from medha_runtime.sampling_params import bad_words_token_ids
from medha_sched import AffineCostModel
from tests.numerics import assert_twice_torch

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
PROMPTS = ["Hello there", "The quick brown fox", "Medha schedules long prompts"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", max_model_len=512, cost_model=COST, seed=0) as llm:
        yield llm


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.5}, "-0.5"),
        ({"temperature": float("nan")}, "nan"),
        ({"top_p": 0.0}, "0.0"),
        ({"top_p": 1.5}, "1.5"),
        ({"top_k": -3}, "-3"),
        ({"top_k": 2.5}, "2.5"),
        ({"max_tokens": 0}, "0"),
        ({"min_tokens": -1}, "-1"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens=9"),
        ({"stop": [""]}, "''"),
        ({"stop": [3]}, "3"),
        ({"stop_token_ids": [-7]}, "-7"),
        ({"logprobs": -2}, "-2"),
        ({"seed": "abc"}, "'abc'"),
        ({"ignore_eos": "yes"}, "'yes'"),
        ({"bad_words": "word"}, "'word'"),
        ({"bad_words": ["ok", ""]}, "''"),
        ({"bad_words": ["  "]}, "'  '"),
        ({"bad_words": [3]}, "3"),
    ],
)
def test_bad_params_name_the_value(kwargs, needle) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value)
    assert next(iter(kwargs)) in str(err.value)


def test_params_normalize_stop() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[5, 6])
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert p.replace(max_tokens=3).max_tokens == 3
    with pytest.raises(ValueError, match="max_tokens"):
        p.replace(max_tokens=-1)
    assert SamplingParams(bad_words=["a", " b"]).bad_words == ("a", " b")
    assert SamplingParams(bad_words=None).bad_words == SamplingParams().bad_words == ()


# ---------------------------------------------------------------- Sampler
def spec(rid: str, **kw) -> SampleSpec:
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 1, "logprobs": None}
    base.update(kw)
    return SampleSpec(rid, **base)


def test_sampler_greedy_topk1_and_tiny_topp_agree() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1).tolist()
    s = Sampler()
    for kw in (
        {"temperature": 0.0},
        {"top_k": 1},
        {"top_p": 1e-6},
        {"temperature": 0.3, "top_k": 1},
    ):
        got = [r.token_id for r in s.sample(logits, [spec(f"r{i}", **kw) for i in range(6)])]
        assert got == want, kw


def test_sampler_seeded_rows_ignore_batch_composition() -> None:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(2, 40, generator=g) for _ in range(5)]

    def draw(with_others: bool) -> list[int]:
        s = Sampler()
        out = []
        for r in rows:
            if with_others:  # the same request beside different neighbours, in another row
                logits = torch.cat([torch.randn(3, 40), r[:1]])
                specs = [spec(f"o{i}", seed=i + 100) for i in range(3)] + [spec("x", seed=7)]
                out.append(s.sample(logits, specs)[-1].token_id)
            else:
                out.append(s.sample(r[:1], [spec("x", seed=7)])[0].token_id)
        return out

    assert draw(False) == draw(True)


def test_sampler_logprobs_and_suppress() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    s = Sampler()
    out = s.sample(logits, [spec(f"r{i}", temperature=0.0, logprobs=3) for i in range(3)])
    ref = torch.log_softmax(logits, -1)
    for i, r in enumerate(out):
        assert r.logprob == pytest.approx(float(ref[i, r.token_id]), abs=1e-6)
        assert len(r.top) == 3 and r.top[0][0] == r.token_id
    top = logits[0].argmax().item()
    out = s.sample(logits[:1], [spec("q", temperature=0.0, suppress=(top,))])
    assert out[0].token_id != top
    # a sampled row's logprob is the model's, not the temperature-scaled distribution's
    r = s.sample(logits[:1], [spec("t", temperature=0.5, logprobs=0)])[0]
    assert r.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[r.token_id]))


def test_logprobs_are_of_the_raw_logits_whatever_the_processing() -> None:
    """Temperature, top-k, top-p, min-p, bias, penalties and min_tokens change which token
    is drawn, not the logprobs reported: they are ``log_softmax`` of the raw logits
    (vLLM's default). The processed distribution gave -inf to every token top_k ruled out
    and moved the rest with the temperature (0.0 for the only token left at top_k=1)."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 4
    truth = torch.log_softmax(logits.double(), -1)
    base = torch.log_softmax(logits, -1)  # the plain fp32 path
    eos = int(logits[3].argmax())
    specs = [
        spec("a", temperature=0.3, top_k=2, logprobs=6),
        spec("b", temperature=1.7, top_p=0.5, min_p=0.1, logprobs=6),
        spec("c", top_k=1, logprobs=6, logit_bias=((7, 100.0),)),
        spec("d", temperature=0.0, logprobs=6, suppress=(eos,),
             penalties=Penalties(1.0, 0.5, 1.3), history=((1, 2, 3), ())),
    ]  # fmt: skip
    out = Sampler().sample(logits, specs)
    assert out[2].token_id == 7 and out[3].token_id != eos
    for i, r in enumerate(out):
        ids = torch.tensor([r.token_id, *(t for t, _ in r.top)])
        got = torch.tensor([r.logprob, *(v for _, v in r.top)])
        assert_twice_torch(got, truth[i, ids], base[i, ids], what=f"row {i} logprobs")
        assert [t for t, _ in r.top] == truth[i].topk(6).indices.tolist()


def test_sampler_forgets_generators() -> None:
    s = Sampler()
    s.sample(torch.randn(2, 10), [spec("a"), spec("b")])
    assert s.num_generators == 2
    s.forget(["a"])
    assert s.num_generators == 1


# ---------------------------------------------------------------- through LLM
def test_seeded_generation_is_reproducible_whatever_the_batch(llm) -> None:
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
    crowd = llm.generate([*PROMPTS, PROMPTS[0]], [SamplingParams(max_tokens=5)] * 3 + [p])
    assert crowd[3].outputs[0].token_ids == alone
    other = llm.generate(PROMPTS[0], p.replace(seed=99))[0].outputs[0].token_ids
    assert other != alone

    # unseeded requests draw their seeds from the LLM's seed: two fresh LLMs agree
    def fresh() -> list[list[int]]:
        with LLM("tiny", max_model_len=512, cost_model=COST, seed=0) as again:
            outs = again.generate(PROMPTS, SamplingParams(max_tokens=6))
        return [o.outputs[0].token_ids for o in outs]

    assert fresh() == fresh()


def test_topk1_and_tiny_topp_equal_greedy(llm) -> None:
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(max_tokens=10))]
    for p in (
        SamplingParams(top_k=1, max_tokens=10, seed=3),
        SamplingParams(top_p=1e-6, max_tokens=10, seed=4),
    ):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)] == want


def test_temperature_changes_the_distribution(llm) -> None:
    want = llm.generate(PROMPTS[1], greedy(max_tokens=24))[0].outputs[0].token_ids
    hot = llm.generate(PROMPTS[1], SamplingParams(temperature=3.0, max_tokens=24, seed=5))
    assert hot[0].outputs[0].token_ids != want
    cold = llm.generate(PROMPTS[1], SamplingParams(temperature=0.01, max_tokens=24, seed=5))
    assert cold[0].outputs[0].token_ids == want


def test_max_tokens_and_ignore_eos(llm) -> None:
    out = llm.generate(PROMPTS, greedy(max_tokens=5, ignore_eos=True))
    for o in out:
        assert len(o.outputs[0].token_ids) == 5
        assert o.outputs[0].finish_reason == "length" and o.finished


def test_stop_strings_truncate_the_text(llm) -> None:
    ref = llm.generate(PROMPTS[2], greedy(max_tokens=24))[0].outputs[0]
    text = ref.text
    i = next(
        i
        for i in range(3, len(text))
        if text[i].isascii() and text[i].isprintable() and text.find(text[i]) == i
    )
    stop = text[i]
    out = llm.generate(PROMPTS[2], greedy(max_tokens=24, stop=["\x00never", stop]))[0].outputs[0]
    assert out.text == text[:i]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    kept = greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate(PROMPTS[2], kept)[0].outputs[0].text == text[: i + 1]


def test_stop_token_ids(llm) -> None:
    ref = llm.generate(PROMPTS[0], greedy(max_tokens=16))[0].outputs[0].token_ids
    k = next(k for k in range(3, len(ref)) if ref.index(ref[k]) == k)
    out = llm.generate(PROMPTS[0], greedy(max_tokens=16, stop_token_ids=[ref[k]]))[0].outputs[0]
    assert out.token_ids == ref[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[k]
    assert out.text == llm.get_tokenizer().decode(ref[:k])  # the stop token is not text
    # unless include_stop_str_in_output (vLLM's rule; it was ignored for stop tokens)
    for stop in ([], ["\x00never"]):  # the text made at once, or later (no stop string)
        kept = greedy(max_tokens=16, stop_token_ids=[ref[k]], include_stop_str_in_output=True)
        out = llm.generate(PROMPTS[0], kept.replace(stop=stop))[0].outputs[0]
        assert out.token_ids == ref[: k + 1] and out.stop_reason == ref[k]
        assert out.text == llm.get_tokenizer().decode(ref[: k + 1])


def test_eos_stops_unless_ignored_and_min_tokens_suppresses_it(llm) -> None:
    ref = llm.generate(PROMPTS[1], greedy(max_tokens=12))[0].outputs[0].token_ids
    k = next(k for k in range(2, len(ref)) if ref.index(ref[k]) == k)
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({ref[k]})  # pretend the model's EOS is that token
    try:
        out = llm.generate(PROMPTS[1], greedy(max_tokens=12))[0].outputs[0]
        assert out.token_ids == ref[: k + 1]
        assert out.finish_reason == "stop" and out.stop_reason is None
        out = llm.generate(PROMPTS[1], greedy(max_tokens=12, ignore_eos=True))[0].outputs[0]
        assert out.token_ids == ref and out.finish_reason == "length"
        out = llm.generate(PROMPTS[1], greedy(max_tokens=12, min_tokens=k + 2))[0].outputs[0]
        assert out.token_ids[:k] == ref[:k] and out.token_ids[k] != ref[k]
        assert len(out.token_ids) >= k + 2
    finally:
        engine.eos_token_ids = saved


def test_logprobs_of_chosen_tokens_equal_log_softmax(llm) -> None:
    out = llm.generate(PROMPTS[0], greedy(max_tokens=8, logprobs=2))[0]
    gen, prompt = out.outputs[0].token_ids, out.prompt_token_ids
    model, _ = load_model("tiny", dtype="float32")
    seq = prompt + gen[:-1]
    blocks = list(range(-(-len(seq) // 16)))
    batch = ForwardBatch.build([seq], [0], [blocks], block_size=16)
    batch.sample_rows = torch.arange(len(seq))
    ref = torch.log_softmax(model(batch, model.allocate_kv_cache(len(blocks), 16)), dim=-1)
    entries = out.outputs[0].logprobs
    assert entries is not None and len(entries) == len(gen)
    total = 0.0
    for i, tok in enumerate(gen):
        want = float(ref[len(prompt) - 1 + i, tok])
        assert entries[i][tok] == pytest.approx(want, abs=1e-4)
        assert len(entries[i]) in (2, 3)  # the chosen token and the top-2 (it is among them)
        total += want
    assert out.outputs[0].cumulative_logprob == pytest.approx(total, abs=1e-3)
    assert llm.generate(PROMPTS[0], greedy(max_tokens=2))[0].outputs[0].logprobs is None


def test_generate_checks_its_inputs(llm) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(PROMPTS, [greedy(), greedy()])
    with pytest.raises(ValueError, match="maximum context length is 512 tokens"):
        llm.generate([[65] * 512], greedy())
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.generate([[65, 9999]], greedy())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy())
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(PROMPTS[:1], [{"temperature": 0}])
    # the context limit lowers max_tokens
    out = llm.generate([[65] * 506], greedy(max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert not llm.engine.has_unfinished_requests()


# ------------------------------------------------- penalties, bias, min_p
def penalized_reference(
    logits: torch.Tensor, prompt: list[int], output: list[int], pen: Penalties
) -> torch.Tensor:
    """vLLM's penalties for one row, token by token (float64)."""
    row = logits.double().clone()
    seen = set(prompt) | set(output)
    for t in seen:
        r = pen.repetition
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(output):
        row[t] -= pen.frequency * output.count(t) + pen.presence
    return row


def test_batched_penalties_match_a_per_token_reference() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 40
    rows = [
        ("a", [1, 2, 3], [4, 4, 5], Penalties(0.5, 0.25, 1.3)),
        ("b", [7], [], Penalties(1.0, 0.0, 1.0)),
        ("c", [2, 2, 9], [9, 9, 9, 1], Penalties(-0.5, 1.5, 0.7)),
    ]
    s = Sampler()
    specs = [
        spec(rid, temperature=0.0, penalties=pen, history=(tuple(p), tuple(o)))
        for rid, p, o, pen in rows
    ] + [spec("plain", temperature=0.0, logit_bias=((3, 2.5), (8, -1.0)))]
    logits = torch.randn(len(specs), vocab, generator=g) * 3
    got = s.process(logits, specs)
    for i, (_, p, o, pen) in enumerate(rows):
        want = penalized_reference(logits[i], p, o, pen)
        # fp32 arithmetic on fp32 inputs: at most a few ulps from the float64 reference
        tol = 4 * torch.finfo(torch.float32).eps * float(want.abs().max())
        assert float((got[i].double() - want).abs().max()) <= tol
    bias = torch.zeros(vocab)
    bias[3], bias[8] = 2.5, -1.0
    assert torch.equal(got[-1], logits[-1] + bias)


def test_sampler_counts_its_own_tokens_between_steps() -> None:
    """After the history, the sampler adds each token it samples: step k sees them all."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=g)
    pen = Penalties(0.0, 5.0, 1.0)  # strong: a token once chosen loses to others
    s = Sampler()
    prompt, out = [1, 2], []
    for step in range(6):
        history = (tuple(prompt), ()) if step == 0 else None
        sp = spec("r", temperature=0.0, penalties=pen, history=history)
        tok = s.sample(logits[step : step + 1], [sp])[0].token_id
        want = int(penalized_reference(logits[step], prompt, out, pen).argmax())
        assert tok == want
        out.append(tok)
    s.forget(["r"])
    # without its history the row cannot be sampled: an error naming it, not an exception
    (bad,) = s.sample(logits[:1], [spec("r", temperature=0.0, penalties=pen)])
    assert bad.error is not None and "history" in bad.error


def test_min_p_one_keeps_only_the_top_token() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3))
    s = Sampler()
    specs = [spec(f"r{i}", temperature=1.5, min_p=1.0, seed=i) for i in range(8)]
    assert [x.token_id for x in s.sample(logits, specs)] == logits.argmax(-1).tolist()


def test_prompt_logprobs_survive_chunked_prefill() -> None:
    """Prompt logprobs from 4-token chunks equal those of one whole-prompt chunk."""
    from medha_runtime import LLM, SamplingParams

    cost = "affine:base=0.01,per_token=0.0001,per_attn=0"
    prompt = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    got = {}
    for chunk in (4, None):
        kw = {} if chunk is None else {"chunk_size": chunk}
        with LLM("tiny", max_model_len=64, kv_cache_tokens=256, cost_model=cost, **kw) as llm:
            got[chunk] = llm.generate([prompt], params)[0].prompt_logprobs
    assert got[4][0] is None and len(got[4]) == len(prompt)
    for a, b in zip(got[4][1:], got[None][1:], strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t] - b[t]) <= 1e-4 * max(1.0, abs(b[t]))


def test_prompt_logprobs_survive_a_preemption_mid_prefill() -> None:
    """A prompt preempted between chunks is recomputed in other chunks (the batch
    no longer shares its 16-token budget with a decode): its prompt logprobs
    still cover every position, equal to an undisturbed run's."""
    a, b = list(range(3, 10)), list(range(20, 80))
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1),
    ]
    got = {}
    # one-token blocks, 68 of them: a's decodes take the last free block, then
    # preempt b, whose first chunks were [0, 9) and [9, 24); alone, b runs [0, 16), ...
    for kv in (68, 256):
        with LLM(
            "tiny",
            cost_model=COST,
            policy="fcfs",
            chunk_size=16,
            block_size=1,
            max_model_len=64,
            kv_cache_tokens=kv,
        ) as llm:
            outs = llm.generate([a, b], params)
        got[kv] = outs[1].prompt_logprobs
        assert outs[1].num_preemptions == (1 if kv == 68 else 0)
    assert got[68][0] is None and len(got[68]) == len(b)
    for x, y in zip(got[68][1:], got[256][1:], strict=True):
        assert x.keys() == y.keys()
        for t in x:
            assert abs(x[t] - y[t]) <= 1e-4 * max(1.0, abs(y[t]))


def test_greedy_argmax_takes_the_first_maximum_like_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (64, 1000), generator=gen).float()  # many ties per row
    logits[0] = 0.0  # every entry tied
    logits[1, [7, 500, 999]] = 9.0
    logits[2, 0] = float("-inf")
    got = greedy_argmax(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[0] == 0 and got[1] == 7


def test_greedy_rows_without_processing_sample_the_logits_as_given() -> None:
    """No bias, suppression or penalty: the sampler leaves the logits untouched, and
    a batch of greedy and drawn rows gives each row what it gives alone."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen)
    before = logits.clone()
    specs = [
        spec(
            f"r{i}", temperature=0.0 if i % 2 == 0 else 0.8, seed=i, logprobs=1 if i == 2 else None
        )
        for i in range(5)
    ]
    together = Sampler().sample(logits, specs)
    assert torch.equal(logits, before)
    for i, one in enumerate(specs):
        (alone,) = Sampler().sample(logits[i : i + 1], [one])
        assert alone == together[i]
    assert [together[i].token_id for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(-1).tolist()


def test_plain_greedy_fast_path_is_the_general_path(monkeypatch) -> None:
    """A batch of greedy rows with no logprobs, bias, suppression or penalties takes the
    arg-max fast path; it answers what the general path answers (ties, -inf, fp16 logits)."""
    import medha_runtime.sampling as sampling

    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 3, (6, 259), generator=gen).float()  # ties in every row
    logits[0] = 0.0
    logits[1, 5] = float("-inf")
    logits[2, [3, 100]] = 7.0
    specs = [spec(f"r{i}", temperature=0.0, seed=i) for i in range(6)]
    calls = []
    real = Sampler.process

    def counted(self, lg, sp):
        calls.append(len(sp))
        return real(self, lg, sp)

    monkeypatch.setattr(Sampler, "process", counted)
    for lg in (logits, logits.half(), logits[2:3]):
        n = lg.shape[0]
        fast = Sampler().sample(lg, specs[:n])
        assert calls == []  # the general path's first step never ran
        with monkeypatch.context() as m:
            m.setattr(sampling, "_plain_greedy", lambda s: False)
            general = Sampler().sample(lg, specs[:n])
        assert calls == [n]
        calls.clear()
        assert fast == general and all(s.logprob is None for s in fast)
        assert [s.token_id for s in fast] == lg.float().argmax(-1).tolist()
    # one row that wants logprobs (or a suppressed token) sends the batch the general way
    for other in (
        spec("x", temperature=0.0, seed=9, logprobs=1),
        spec("y", temperature=0.0, seed=9, suppress=(2,)),
    ):
        Sampler().sample(logits[:2], [specs[0], other])
        assert calls == [2]
        calls.clear()


def test_allowed_token_ids_are_the_only_tokens_drawn() -> None:
    logits = torch.randn(1, 60, generator=torch.Generator().manual_seed(5))
    allowed = (3, 17, 41)
    s = Sampler()
    drawn = {
        s.sample(logits, [spec(f"a{i}", seed=i, allowed=allowed)])[0].token_id for i in range(200)
    }
    assert drawn <= set(allowed) and len(drawn) > 1  # sampled: more than one of them
    best = max(allowed, key=lambda t: float(logits[0, t]))
    r = s.sample(logits, [spec("g", temperature=0.0, logprobs=0, allowed=allowed)])[0]
    assert r.token_id == best
    assert r.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[best]), abs=1e-6)
    assert SamplingParams(allowed_token_ids=[9, 3, 9]).allowed_token_ids == (3, 9)
    for bad in ([], [-1], "12", [1.5]):
        with pytest.raises(ValueError, match="allowed_token_ids must be"):
            SamplingParams(allowed_token_ids=bad)


def test_llm_draws_only_allowed_tokens_and_refuses_ids_past_the_vocabulary(llm) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    allowed = [7, 8, 9]
    out = llm.generate([[5, 6, 7]], dataclasses.replace(p, allowed_token_ids=allowed))
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 100000 is outside"):
        llm.generate([[5, 6, 7]], dataclasses.replace(p, allowed_token_ids=[1, 100000]))


# ---------------------------------------------------------------- bad_words
def rising(vocab: int = 20, *top: int) -> torch.Tensor:
    """fp32 ``[1, vocab]`` logits whose most likely tokens are ``top`` (in that order)."""
    logits = torch.zeros(1, vocab)
    for rank, tok in enumerate(top):
        logits[0, tok] = 10.0 - rank
    return logits


def test_a_single_token_bad_word_is_never_drawn_and_logprobs_stay_raw() -> None:
    logits = rising(20, 5, 9, 2)
    s = Sampler()
    r = s.sample(logits, [spec("g", temperature=0.0, logprobs=1, bad_words=((5,),))])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert r.token_id == 9 and r.logprob == pytest.approx(float(raw[9]), abs=1e-6)
    assert r.top[0][0] == 5  # the model's own most likely token, banned or not
    drawn = {
        s.sample(logits, [spec(f"d{i}", seed=i, bad_words=((5,), (9,)))])[0].token_id
        for i in range(100)
    }
    assert drawn and not drawn & {5, 9}
    # a bias cannot bring a bad word back, and the bias still moves the others
    biased = spec("b", temperature=0.0, bad_words=((5,),), logit_bias=((5, 100.0), (2, 5.0)))
    assert s.sample(logits, [biased])[0].token_id == 2


def test_a_multi_token_bad_words_last_token_is_banned_only_after_its_prefix() -> None:
    first, second = rising(20, 3, 9), rising(20, 7, 9)
    word = ((3, 7),)
    s = Sampler()
    # step 1 draws 3 (the prefix); at step 2 the word's last token 7 is banned
    assert s.sample(first, [spec("w", temperature=0.0, bad_words=word)])[0].token_id == 3
    assert s.sample(second, [spec("w", temperature=0.0, bad_words=word)])[0].token_id == 9
    # without the prefix just before, 7 is drawn: first token, or after another token
    assert s.sample(second, [spec("x", temperature=0.0, bad_words=word)])[0].token_id == 7
    assert s.sample(second, [spec("x", temperature=0.0, bad_words=word)])[0].token_id == 7
    # the engine's history (prompt, output) gives the prefix of a request seen anew
    resumed = spec("y", temperature=0.0, bad_words=((4, 3, 7),), history=((3,), (4, 3)))
    assert s.sample(second, [resumed])[0].token_id == 9
    prompt_only = spec("z", temperature=0.0, bad_words=word, history=((3,), ()))
    assert s.sample(second, [prompt_only])[0].token_id == 7  # the prompt is no prefix
    s.forget(["w"])
    assert s.sample(second, [spec("w", temperature=0.0, bad_words=word)])[0].token_id == 7


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=12),
    output=st.lists(st.integers(0, 5), max_size=10),
)
def test_bad_word_ends_are_found_by_prefix_as_by_a_scan(words, output) -> None:
    """The words are looked up by their prefix (one dict lookup per word length; a scan
    of 100K words took 14 ms a step); the tokens banned after each output token are the
    last tokens of the words whose rest the output ends with, as a plain scan finds them."""
    import medha_runtime.sampling as sampling

    bad = tuple(tuple(w) for w in words)
    s = Sampler()
    sp = spec("p", temperature=0.0, bad_words=bad, history=((), tuple(output)))
    b = s._request_bans(sp, 6, torch.device("cpu"))
    assert isinstance(b, sampling._Bans)
    tail = list(b.tail)
    want = sorted(
        w[-1]
        for w in bad
        if len(w) > 1
        and len(w) - 1 <= len(tail)
        and tuple(tail[len(tail) - len(w) + 1 :]) == w[:-1]
    )
    assert sorted(b.word_ends()) == want


def test_bad_words_must_be_unicode_text() -> None:
    """A lone surrogate (JSON's "\\ud800") reached the tokenizer, whose TypeError was a 500
    on the server and not the ValueError the engine promises offline."""
    with pytest.raises(ValueError, match="bad_words must be a list of Unicode strings"):
        SamplingParams(bad_words=["ok", "\ud800"])


def test_bad_words_compose_with_allowed_tokens_and_min_tokens() -> None:
    logits = rising(20, 5, 9, 2, 11)
    s = Sampler()
    both = spec("a", temperature=0.0, allowed=(5, 9, 11), bad_words=((5,),))
    assert s.sample(logits, [both])[0].token_id == 9
    held = spec("m", temperature=0.0, allowed=(5, 9, 11), bad_words=((5,),), suppress=(9,))
    assert s.sample(logits, [held])[0].token_id == 11
    # a word's last token that is the only one left to draw is not banned (no empty row)
    only = spec("o", seed=1, allowed=(7,), bad_words=((3, 7),), history=((), (3,)))
    assert s.sample(rising(20, 7), [only])[0].token_id == 7


def test_the_token_mask_is_built_once_per_request(monkeypatch) -> None:
    import medha_runtime.sampling as sampling

    built = []
    real = sampling._token_mask

    def counted(*args):
        built.append(args)
        return real(*args)

    monkeypatch.setattr(sampling, "_token_mask", counted)
    logits = rising(30, 4, 8, 12)
    s = Sampler()
    for _ in range(5):
        rows = [spec("a", seed=2, allowed=(8, 12)), spec("b", temperature=0.0, bad_words=((4,),))]
        got = [r.token_id for r in s.sample(logits.expand(2, -1), rows)]
        assert got[0] in (8, 12) and got[1] == 8
    assert len(built) == 2  # one per request, not one per step
    s.forget(["a", "b"])
    # a finished request's mask is dropped: a new request of that id builds its own
    assert s.sample(logits, [spec("a", temperature=0.0, allowed=(12,))])[0].token_id == 12
    assert len(built) == 3


def test_bad_words_token_ids_follow_vllm() -> None:
    tok = tiny_tokenizer()

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    # tiny's bytes: " ab" is one token more than "ab", so only "ab" is kept (as vLLM)
    assert bad_words_token_ids(["ab", "  ab", "c"], encode) == ((97, 98), (99,))


def test_llm_never_draws_a_bad_word(llm) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = llm.generate(["The quick brown fox"], greedy)[0].outputs[0]
    first, second = plain.token_ids[:2]
    assert first == ord(plain.text[0]) < 128  # a byte token of tiny: its own character
    out = llm.generate(["The quick brown fox"], greedy.replace(bad_words=[chr(first)]))
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 12 and first not in ids
    # a two-token word: its first token is drawn as before, then its last is not
    word = chr(first) + chr(second)
    ids = llm.generate(["The quick brown fox"], greedy.replace(bad_words=[word]))[0]
    ids = ids.outputs[0].token_ids
    assert ids[0] == first and ids[1] != second
    assert all(ids[i : i + 2] != [first, second] for i in range(len(ids) - 1))


def test_llm_refuses_bad_words_that_leave_nothing_to_draw(llm) -> None:
    p = SamplingParams(max_tokens=3, allowed_token_ids=[ord("x"), ord("y")], bad_words=["x", "y"])
    with pytest.raises(ValueError, match=r"^bad_words: .*no token could be drawn"):
        llm.generate([[5, 6]], p)
    eos = sorted(llm.engine.eos_token_ids)[0]
    held = p.replace(allowed_token_ids=[ord("x"), eos], min_tokens=1)
    with pytest.raises(ValueError, match=r"^bad_words: .*min_tokens=1"):
        llm.generate([[5, 6]], held)
    ok = p.replace(allowed_token_ids=[ord("x"), ord("z")], temperature=0.0)
    assert llm.generate([[5, 6]], ok)[0].outputs[0].token_ids == [ord("z")] * 3
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kw", "seen_tokens"),
    [
        # fp32 holds 1e-300 as 0: a seen token's positive logit / 0 was +inf, softmax NaN
        ({"penalties": Penalties(0.0, 0.0, 1e-300)}, True),
        ({"penalties": Penalties(0.0, 0.0, 1e-40)}, True),
        # fp32 holds 1e300 as inf: 0 x inf was NaN
        ({"penalties": Penalties(0.0, 0.0, 1e300)}, True),
        # a ruled-out token's -inf / inf was NaN
        ({"temperature": 1e300, "suppress": (3, 4)}, False),
        ({"temperature": 1e300, "allowed": (5, 6)}, False),
    ],
)
def test_extreme_valid_values_draw_a_token_not_a_nan(kw: dict, seen_tokens: bool) -> None:
    """Such a request stopped the engine ("probability tensor contains either inf, nan");
    now it draws, and never a ruled-out token."""
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(5)) * 4
    logits[0, 7] = 0.0  # a seen token with a 0 logit
    history = ((1, 2, 7), (9,)) if seen_tokens else None
    s = Sampler()
    sp = spec("r", seed=3, history=history, **kw)
    toks = [s.sample(logits, [sp])[0].token_id for _ in range(20)]
    assert all(0 <= t < 20 for t in toks)
    assert not set(toks) & {3, 4}
    if "allowed" in kw:
        assert set(toks) <= {5, 6}
    if kw.get("penalties") is not None and kw["penalties"].repetition < 1e-30:
        # a positive seen logit over a (near) zero penalty is the most likely by far
        best = {t for t in (1, 2, 9) if logits[0, t] > 0}
        if best:
            assert set(toks) <= best


# ------------------------------------------------- a row that cannot be sampled
@pytest.mark.parametrize("at", [0, 1, 2, 3, 4])
def test_a_row_that_fails_gets_an_error_and_the_others_their_own_tokens(at: int) -> None:
    """Non-finite logits in one row make ``torch.multinomial`` raise: that row gets an
    error naming the cause, and the others (retried one by one) exactly the tokens of a
    batch without it, at this step and the next (a seeded row drawn before the failure is
    not drawn again; a penalized row's token is counted once), wherever the bad row is."""
    g = torch.Generator().manual_seed(4)
    steps = [torch.randn(5, 30, generator=g) * 2 for _ in range(4)]
    pen = Penalties(0.0, 0.7, 1.0)  # the counts are compared below, once against twice
    words = ((7, 8, 9), (4, 5))  # bad words of several tokens: the sampler keeps a tail

    def specs(step: int) -> list[SampleSpec]:
        history = ((1, 2), ()) if step == 0 else None
        return [
            spec("drawn", temperature=0.8, seed=3, logprobs=2),
            spec("later", temperature=1.3, seed=5),
            spec("pen", temperature=0.3, seed=9, penalties=pen, history=history),
            spec("pen-greedy", temperature=0.0, penalties=pen, history=history),
            spec("words", temperature=2.0, seed=13, bad_words=words),
        ]

    def run(with_bad: bool) -> tuple[list[list[tuple]], dict]:
        s, out = Sampler(), []
        for step, logits in enumerate(steps):
            rows, sp = logits, specs(step)
            if with_bad and step == 0:  # the bad row at ``at``
                bad = torch.full((1, 30), float("nan"))
                rows = torch.cat([logits[:at], bad, logits[at:]])
                sp = [*sp[:at], spec("bad", seed=11), *sp[at:]]
            got = s.sample(rows, sp)
            if with_bad and step == 0:
                assert got[at].error is not None and "probability tensor" in got[at].error
                got = [*got[:at], *got[at + 1 :]]
            assert all(r.error is None for r in got)
            out.append([tuple(r) for r in got])
        state = {rid: h.output.tolist() for rid, h in s._histories.items()}
        state |= {f"{rid} tail": b.tail for rid, b in s._bans.items() if b.words}
        return out, state

    with_bad, without = run(True), run(False)
    assert with_bad[0] == without[0]
    assert with_bad[1] == without[1] and set(with_bad[1]) == {"pen", "pen-greedy", "words tail"}
