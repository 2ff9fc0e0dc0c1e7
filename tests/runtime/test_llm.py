"""``LLM`` in one process: greedy parity with transformers whatever the chunking, errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from medha_runtime import LLM, SamplingParams
from medha_runtime.model import ConfigError, MissingFileError
from medha_runtime.model.tiny import save_tiny
from medha_sched import AffineCostModel
from medha_sched.cost.online import OnlineCostModel
from tests.runtime.checkpoints import hf_greedy, hf_model

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 23, 41, 64)]


@pytest.fixture(scope="module")
def reference(checkpoint) -> tuple[Path, list[list[int]], list[list[int]]]:
    path = checkpoint("gqa-llama3-tied-sharded")
    prompts = _prompts(97)
    model = hf_model(path)
    return path, prompts, [hf_greedy(model, p, NEW) for p in prompts]


CASES = {
    "fcfs-chunk7": {"policy": "fcfs", "chunk_size": 7},
    "fcfs-chunk16": {"policy": "fcfs", "chunk_size": 16},
    "fcfs-whole": {"policy": "fcfs", "chunk_size": 0},
    "lars-chunk13": {"policy": "lars", "chunk_size": 13},
    # adaptive chunking against a tiny budget: chunks of 8-24 tokens
    "lars-mp-adaptive": {
        "policy": "lars-mp",
        "token_grid": 8,
        "target_batch_time": 1e-3 + 24e-5,
        "cost_model": AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-12),
    },
    # a KV pool too small for all four: decodes preempt (recompute) others
    "preempting": {"policy": "fcfs", "chunk_size": 16, "kv_cache_tokens": 88, "block_size": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(reference, case: str) -> None:
    path, prompts, want = reference
    kw = {"cost_model": COST, **CASES[case]}
    with LLM(path, dtype="float32", **kw) as llm:
        outs = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.prompt_token_ids == p for o, p in zip(outs, prompts, strict=True))
    assert all(o.outputs[0].text == "" for o in outs)  # no tokenizer.json in the checkpoint
    assert stats.decode_tokens > 0
    if case == "preempting":
        assert stats.preemptions > 0
        assert sum(o.num_preemptions for o in outs) == stats.preemptions
    elif case != "fcfs-whole":
        assert stats.prefill_tokens == sum(map(len, prompts))
        assert stats.steps > 10  # prompts were split into chunks


def test_legacy_checkpoint_matches_transformers(checkpoint) -> None:
    path = checkpoint("gqa-llama3-legacy")
    prompts = _prompts(97)[1:3]
    want = [hf_greedy(hf_model(path), p, NEW) for p in prompts]
    with LLM(path, dtype="float32", cost_model=COST, policy="fcfs", chunk_size=9) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_saved_tiny_directory_equals_builtin_tiny(tmp_path) -> None:
    directory = save_tiny(tmp_path / "tiny")
    prompts = ["Hello", "Medha runs tiny from a directory too"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with (
        LLM(directory, cost_model=COST, max_model_len=256) as a,
        LLM("tiny", cost_model=COST, max_model_len=256) as b,
    ):
        got, want = a.generate(prompts, params), b.generate(prompts, params)
    for x, y in zip(got, want, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.prompt == y.prompt


def test_prompt_forms_and_chat() -> None:
    with LLM("tiny", cost_model=COST, max_model_len=256) as llm:
        tok = llm.get_tokenizer()
        ids = tok.encode("hi")
        params = SamplingParams(temperature=0.0, max_tokens=4)
        forms = [
            llm.generate("hi", params),
            llm.generate(ids, params),
            llm.generate([ids], params),
            llm.generate({"prompt": "hi"}, params),
            llm.generate([{"prompt_token_ids": ids}], params),
        ]
        first = forms[0][0].outputs[0].token_ids
        assert all(len(f) == 1 and f[0].outputs[0].token_ids == first for f in forms)
        assert forms[0][0].prompt == "hi" and forms[1][0].prompt is None
        messages = [{"role": "user", "content": "hello"}]
        out = llm.chat(messages, params)
        assert out[0].prompt_token_ids == tok.apply_chat_template(messages, tokenize=True)
        assert len(llm.chat([messages, messages], params)) == 2
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hi", params)


def test_default_cost_model_is_calibrated_at_start_and_learns() -> None:
    with LLM("tiny", max_model_len=1024) as llm:
        cost = llm.engine.cost_model
        assert isinstance(cost, OnlineCostModel) and cost.coefficients["step"] > 0
        assert cost.steps == 0
        assert llm.engine.scheduler_config.target_batch_time >= 0.05
        out = llm.generate("calibrated", SamplingParams(temperature=0.0, max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
        feedback = llm.engine.cost_feedback
        assert feedback.steps >= 3 and len(feedback.recent) == feedback.steps
        assert cost.steps + len(cost.errors) > 0  # every step reached the model


def test_cost_model_spec_string() -> None:
    with LLM("tiny", cost_model="affine:base=0.001,per_token=1e-5,per_attn=1e-9") as llm:
        assert llm.engine.cost_model == AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)


def test_offline_budget_fits_a_throughput_chunk_and_the_server_default_does_not(
    tmp_path,
) -> None:
    """``LLM`` raises the automatic budget to fit a 2,048-token chunk at 10% to spare
    (offline throughput); ``throughput_chunk=None`` keeps the latency-bounded default,
    which here splits the same prompt into many chunks."""
    cost = "affine:base=0.01,per_token=0.001,per_attn=0"  # a 2,048-token chunk: 2.058 s
    prompt = [[7 + i % 50 for i in range(600)]]
    steps = {}
    for name, kw in (("offline", {}), ("server", {"throughput_chunk": None})):
        log = tmp_path / f"{name}.jsonl"
        with LLM("tiny", cost_model=cost, max_model_len=1024, step_log=str(log), **kw) as llm:
            target = llm.engine.scheduler_config.target_batch_time
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))
        steps[name] = len(log.read_text().splitlines())
        if name == "offline":  # the context caps the chunk: 1,023 tokens at most
            assert target == pytest.approx(1.1 * (0.01 + 0.001 * 1023))
        else:  # twice one 32-token grid chunk, or 50 ms
            assert target == pytest.approx(max(0.05, 2 * (0.01 + 0.001 * 32)))
    assert steps["offline"] == 2  # the whole prompt in one chunk, then one decode
    assert steps["server"] > 2 * steps["offline"]


def test_bad_configurations_raise_clear_errors(tmp_path, checkpoint) -> None:
    with pytest.raises(MissingFileError, match="no/such/model"):
        LLM(tmp_path / "no/such/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingFileError, match=r"config\.json"):
        LLM(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json"):
        LLM(tmp_path / "broken")
    bad = {
        "tp=3": ({"tp": 3}, "tp=3"),
        "spp": ({"spp": 9}, "spp=9"),
        "kvp": ({"kvp": 0}, "kvp"),
        "group": ({"kvp": 2, "kvp_group_tokens": 30}, "kvp_group_tokens=30"),
        "len": ({"max_model_len": 10**6}, "max_model_len=1000000"),
        "policy": ({"policy": "nope"}, "nope"),
        "dtype": ({"dtype": "int8"}, "int8"),
        "device": ({"device": "tpu"}, "tpu"),
        "fit": ({"kv_cache_tokens": 64, "max_model_len": 128}, "max_model_len=128"),
        "throughput": ({"throughput_chunk": 0}, "throughput_chunk"),
    }
    for name, (kw, needle) in bad.items():
        with pytest.raises(ValueError, match=needle):
            LLM("tiny", cost_model=COST, **kw)
        assert name
    with LLM(checkpoint("gqa-llama3-tied-sharded"), cost_model=COST) as llm:
        with pytest.raises(ValueError, match=r"no tokenizer\.json"):
            llm.generate("text needs a tokenizer", GREEDY)
        with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
            llm.generate([[5] * 128], GREEDY)


def test_engine_abort_frees_the_request() -> None:
    with LLM("tiny", cost_model=COST, max_model_len=256, policy="fcfs", chunk_size=8) as llm:
        engine = llm.engine
        rid = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=5))
        engine.step()  # the first chunk of its prefill
        out = engine.abort_request(rid)
        assert out is not None and out.outputs[0].finish_reason == "abort"
        assert not engine.has_unfinished_requests() and engine.abort_request(rid) is None
        again = llm.generate("ok", SamplingParams(temperature=0.0, max_tokens=3))
        assert len(again[0].outputs[0].token_ids) == 3


def test_attention_backend_is_used_in_process_and_a_bad_one_refused() -> None:
    """``attention_backend`` reached the layers only with kvp > 1: with one KVP group every
    layer kept "auto" whatever was asked, and an unknown name ran as "auto"."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        with LLM("tiny", cost_model=COST, max_model_len=128, attention_backend=backend) as llm:
            runner = llm.engine.executor.runner
            fns = {layer.self_attn.attn_fn.backend for layer in runner.model.layers.values()}
            assert fns == {backend} and runner._plan_key["backend"] == backend
            outs[backend] = llm.generate("backend", params)[0].outputs[0].token_ids
    assert outs["torch"] == outs["auto"]
    with pytest.raises(ValueError, match="unknown attention_backend 'nope'; known: auto, torch"):
        LLM("tiny", cost_model=COST, attention_backend="nope")


def test_attention_backends_match_the_kernels_registry() -> None:
    from medha_kernels.backends import BACKENDS
    from medha_runtime.config import ATTENTION_BACKENDS

    assert ("auto", *BACKENDS) == ATTENTION_BACKENDS


def test_cost_model_out_that_cannot_be_written_is_refused_at_start(tmp_path) -> None:
    """It failed at shutdown, after all the work, with the state lost (FileNotFoundError)."""
    for path, needle in (
        (tmp_path / "missing" / "cost.json", "no directory"),
        (tmp_path, "it is a directory"),
    ):
        with pytest.raises(ValueError, match=f"cannot write cost_model_out=.*{needle}"):
            LLM("tiny", max_model_len=64, cost_model_out=str(path))
    out = tmp_path / "cost.json"
    with LLM("tiny", max_model_len=64, cost_model_out=str(out)) as llm:
        llm.generate("saved", SamplingParams(temperature=0.0, max_tokens=2))
    assert out.is_file()


def test_chat_takes_text_parts_and_names_a_bad_message() -> None:
    """Text parts (as the server takes them) failed in the template ("can only concatenate
    str"), a plain string was rendered letter by letter as messages, a missing content
    failed inside the template."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM("tiny", cost_model=COST, max_model_len=256) as llm:
        plain = llm.chat([{"role": "user", "content": "hi\nthere"}], params)[0]
        parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
        split = llm.chat([[{"role": "user", "content": parts}]], params)[0]
        assert split.prompt_token_ids == plain.prompt_token_ids
        bad = {
            "a string": ("hello", "chat takes a conversation"),
            "no content": ([{"role": "user", "text": "hi"}], "message 0: 'content' must be"),
            "no role": ([{"content": "hi"}], "message 0: 'role' must be"),
            "an image": (
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                "content part 0 must be",
            ),
            "a string conversation": (["hi", "there"], "conversation 0 must be a list"),
        }
        for messages, needle in bad.values():
            with pytest.raises(ValueError, match=needle):
                llm.chat(messages, params)


def test_a_prompt_dict_with_other_keys_is_refused() -> None:
    """vLLM's prompt dicts carry multi_modal_data, mm_processor_kwargs...: they were
    silently dropped, as was a misspelt key beside 'prompt'."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM("tiny", cost_model=COST, max_model_len=128) as llm:
        for prompt, needle in (
            ({"prompt": "hi", "multi_modal_data": {"image": None}}, "multi_modal_data"),
            ([{"prompt": "hi", "prompt_token_id": [5]}], "prompt_token_id;"),
        ):
            with pytest.raises(ValueError, match=f"prompt 0: unsupported key.*{needle}"):
                llm.generate(prompt, params)
        both = llm.generate({"prompt": "hi", "prompt_token_ids": [104, 105]}, params)[0]
        assert both.prompt == "hi" and both.prompt_token_ids == [104, 105]


def test_a_chat_template_of_the_engine_or_of_one_call_is_used(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("<{{ messages[-1]['content'] }}>", encoding="utf-8")
    messages = [{"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM("tiny", cost_model=COST, max_model_len=256, chat_template=str(path)) as llm:
        tok = llm.get_tokenizer()
        out = llm.chat(messages, params)
        assert out[0].prompt_token_ids == tok.encode("<hello>", add_special_tokens=False)
        out = llm.chat(messages, params, chat_template="({{ messages[0]['role'] }})")
        assert out[0].prompt_token_ids == tok.encode("(user)", add_special_tokens=False)
        with pytest.raises(ValueError, match="no such file"):
            llm.chat(messages, params, chat_template=str(tmp_path / "none.jinja"))


def test_chat_continues_the_final_message_and_passes_template_variables() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "So"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM("tiny", cost_model=COST, max_model_len=256) as llm:
        tok = llm.get_tokenizer()
        out = llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True)
        text = tok.decode(out[0].prompt_token_ids, skip_special_tokens=False)
        assert text.endswith("So")
        flag = "{% if flag %}F{% endif %}{{ messages[0]['content'] }}"
        out = llm.chat(messages, params, chat_template=flag, chat_template_kwargs={"flag": True})
        assert out[0].prompt_token_ids == tok.encode("Fhi", add_special_tokens=False)
        with pytest.raises(ValueError, match="'messages'"):
            llm.chat(messages, params, chat_template_kwargs={"messages": []})


def test_generate_shows_a_progress_bar_unless_told_not_to(capsys) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM("tiny", cost_model=COST, max_model_len=128) as llm:
        llm.generate([[5, 6, 7], [8, 9]], params)
        err = capsys.readouterr().err
        assert "Processed prompts" in err and "2/2" in err and "output:" in err
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
        llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
        assert capsys.readouterr().err == ""
        with pytest.raises(ValueError, match="use_tqdm must be"):
            llm.generate([[5, 6, 7]], params, use_tqdm="yes")
        assert not llm.engine.has_unfinished_requests()  # the refused call left nothing


def test_truncating_to_all_that_fits_stops_at_what_kv_memory_admits() -> None:
    """-1 keeps as many tokens as fit: with a KV pool smaller than the context, that is
    the longest prompt the scheduler admits, not max_model_len - 1."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=-1)
    with LLM("tiny", cost_model=COST, kv_cache_tokens=128, block_size=16) as llm:
        admit = llm.engine.scheduler.max_admit_tokens
        assert admit < llm.engine.max_model_len - 1
        out = llm.generate([list(range(3, 253))], greedy)[0]
        assert len(out.prompt_token_ids) == admit


def test_allowed_tokens_all_held_back_by_min_tokens_are_refused() -> None:
    with LLM("tiny", cost_model=COST, max_model_len=64) as llm:
        eos = sorted(llm.engine.eos_token_ids)[0]
        bad = SamplingParams(allowed_token_ids=[eos], min_tokens=1, max_tokens=3)
        with pytest.raises(ValueError, match=r"every allowed token .* min_tokens=1 holds back"):
            llm.generate([[5, 6]], bad)
        ok = SamplingParams(allowed_token_ids=[eos], min_tokens=1, max_tokens=3, ignore_eos=True)
        assert llm.generate([[5, 6]], ok)[0].outputs[0].token_ids == [eos] * 3
        assert not llm.engine.has_unfinished_requests()
