"""``smollm2`` (a real trained model from a GGUF) against transformers' own GGUF loader.

transformers reads the same file (``from_pretrained(dir, gguf_file=...)``,
dequantized to fp32): greedy tokens, tokenizer ids, chat template text and
decoding must all agree; tensor parallelism must give the same greedy tokens.

SmolLM2-135M has 9 query and 3 KV heads, so its TP degree must divide 3: the
TP run uses 3 ranks (TP2 cannot split 3 KV heads; TP2 over a quantized GGUF is
covered with a 4-head model in ``test_gguf.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from medha_runtime import LLM, SamplingParams
from medha_runtime.engine import load_model_info
from medha_runtime.model import load_model
from medha_sched import AffineCostModel
from tests.runtime.checkpoints import greedy, hf_greedy

MAX_NEW = 24
COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
TRICKY = [
    "2024 is 12345 and 3.14159, not 1,000,000",
    " 42  leading space and  double  spaces   and    four",
    "héllo wörld — naïve café, Straße, 日本語のテキスト, Привет",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷 and ZWJ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\nnew\n\n\nlines\r\n and trailing   ",
    "code: for (i = 0; i < n; i++) { x += a[i] * 2; } // done",
    "",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path):
    """transformers' model and tokenizer from the same GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": smollm2_gguf.name}
    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, dtype=torch.float32, **kw
    ).eval()
    model.generation_config.eos_token_id = None  # exactly MAX_NEW tokens
    model.generation_config.pad_token_id = 0
    return model, tok


@pytest.fixture(scope="module")
def ours(smollm2_gguf: Path):
    config, tokenizer = load_model_info(str(smollm2_gguf))
    return tokenizer, config


def _prompts(tokenizer) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=True)
        for c in CHATS
    ]
    return [tokenizer.encode(p) for p in COMPLETIONS] + chats


@pytest.fixture(scope="module")
def expected(reference, ours) -> list[list[int]]:
    model, _ = reference
    return [hf_greedy(model, p, MAX_NEW) for p in _prompts(ours[0])]


def test_config_from_metadata(ours) -> None:
    _, c = ours
    assert (c.num_layers, c.hidden_size, c.num_q_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.intermediate_size, c.vocab_size, c.head_dim) == (1536, 49152, 64)
    assert c.tie_word_embeddings and c.rope.theta == 100000.0 and c.eos_token_ids == (2,)


def test_tokenizer_ids_match_transformers(reference, ours) -> None:
    _, hf_tok = reference
    tok = ours[0]
    for text in TRICKY:
        for special in (False, True):
            want = hf_tok.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == want, (text, special)
    assert tok.stop_token_ids == (2,) and tok.eos_token == hf_tok.eos_token == "<|im_end|>"


def test_decode_round_trips(reference, ours) -> None:
    _, hf_tok = reference
    tok = ours[0]
    for text in TRICKY:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        stream = tok.detokenizer()
        pieces = [stream.add([i]) for i in ids] + [stream.flush()]
        assert "".join(pieces) == tok.decode(ids)


def test_chat_template_matches_transformers(reference, ours) -> None:
    _, hf_tok = reference
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    for messages in (chat, chat[1:2]):
        want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours[0].apply_chat_template(messages) == want


def _generate(path: Path, prompts: list[list[int]], tp: int) -> list[list[int]]:
    """Greedy tokens from the engine (batched, chunked prefill), ``tp`` ranks."""
    cost = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(
        str(path), tp=tp, dtype="float32", cost_model=cost, max_model_len=256,
        kv_cache_tokens=1024, policy="fcfs", chunk_size=64,
    ) as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers(smollm2_gguf, ours, expected) -> None:
    """fp32, 3 completions and 3 chats x 24 tokens: the same tokens as transformers, from
    the model alone (one prompt at a time) and from the engine (batched, chunked)."""
    model, _ = load_model(smollm2_gguf, dtype="float32")
    prompts = _prompts(ours[0])
    assert greedy(model, prompts[0], MAX_NEW, chunk=16) == expected[0]
    assert greedy(model, prompts[-1], MAX_NEW, chunk=16) == expected[-1]
    assert _generate(smollm2_gguf, prompts, tp=1) == expected


def test_chat_answers_paris(ours, expected) -> None:
    tok = ours[0]
    answer = tok.decode(expected[len(COMPLETIONS)])
    assert "Paris" in answer, answer


def test_tp3_greedy_matches(smollm2_gguf, ours, expected) -> None:
    """Three gloo worker ranks, each loading only its rows of the GGUF: the same tokens."""
    assert _generate(smollm2_gguf, _prompts(ours[0]), tp=3) == expected


def test_bad_words_take_the_word_with_and_without_a_leading_space(ours) -> None:
    from medha_runtime.sampling_params import bad_words_token_ids

    tokenizer, _ = ours

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    (paris,), (spaced,) = encode("Paris"), encode(" Paris")
    assert paris != spaced  # a word's token at a text's start differs from one inside it
    hello, hello_spaced = tuple(encode("hello world")), tuple(encode(" hello world"))
    assert len(hello) == len(hello_spaced) == 2
    got = bad_words_token_ids([" Paris", "hello world", "Paris"], encode)
    assert got == ((paris,), (spaced,), hello, hello_spaced)
