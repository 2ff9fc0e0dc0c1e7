"""Generate text offline with Medha's runtime, vLLM style.

``LLM("tiny")`` is Medha's built-in model: a Llama 3 shape with RANDOM
weights (its text is gibberish) and a byte-level tokenizer, so this runs on
any CPU without downloading anything. Point ``LLM`` at a local Hugging Face
Llama directory to generate real text. The scheduler splits long prompts
into chunks and mixes them with decodes; ``tp``/``spp``/``kvp`` > 1 start one
worker process per rank.

    python examples/runtime_offline.py
"""

from __future__ import annotations

import time

from medha_runtime import LLM, SamplingParams


def main() -> None:
    prompts = [
        "Hello, my name is",
        "The capital of France is",
        "A long prompt is chunked by the scheduler: " + "lorem ipsum " * 40,
    ]
    start = time.perf_counter()
    with LLM("tiny", max_model_len=4096, seed=0) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        outputs = llm.generate(prompts, greedy)  # one batch: chunked prefills and decodes
        for out in outputs:
            c = out.outputs[0]
            print(f"greedy  {len(out.prompt_token_ids):4d} prompt tokens -> {c.token_ids}")
            print(f"        text {c.text!r} ({c.finish_reason})")

        sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=1, logprobs=0)
        c = llm.generate(prompts[0], sampled)[0].outputs[0]
        print(f"sampled {c.token_ids} (cumulative logprob {c.cumulative_logprob:.2f})")

        # Stop strings cut the text before the match.
        text = outputs[0].outputs[0].text
        stop = next((ch for ch in text[2:] if ch.isalnum()), None) or "x"
        c = llm.generate(prompts[0], SamplingParams(temperature=0.0, stop=[stop]))[0].outputs[0]
        print(f"stop={stop!r}: text {c.text!r} ({c.finish_reason}, stop_reason={c.stop_reason!r})")

        # Prefix caching (on by default): the long prompt's KV blocks are still
        # cached, so asking about it again computes only what follows them.
        again = llm.generate(prompts[2] + " and again?", greedy)[0]
        print(
            f"prefix cache: {again.num_cached_tokens} of {len(again.prompt_token_ids)} "
            "prompt tokens reused"
        )
        assert again.num_cached_tokens > 0
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
