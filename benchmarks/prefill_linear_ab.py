"""One process, alternating: ``transformers``, ``LLM`` with BLAS products, ``LLM`` with oneDNN's.

The 2,048-token prefill of ``engine_vs_transformers.py`` times each side once per
run, minutes apart from the next run; here every round prefills a fresh random
prompt (no prefix-cache hit) with ``transformers``' ``generate``, then ``LLM``
with ``medha_kernels.linear``'s oneDNN path off (what ``MEDHA_ONEDNN_LINEAR=0``
gives), then on, one thread, user + system CPU time of the process, on the same
random SmolLM2-135M-shaped fp32 checkpoint.

    python benchmarks/prefill_linear_ab.py --rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from engine_vs_transformers import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    from medha_runtime import LLM, SamplingParams

    linear_module = importlib.import_module("medha_kernels.linear")
    enabled = linear_module._onednn_enabled
    n = args.prefill
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt")
        hf = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        llm = LLM(
            str(ckpt),
            dtype="float32",
            device="cpu",
            max_model_len=n + 80,
            kv_cache_tokens=n + 1024,
            num_threads=1,
        )
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def peer(prompt: list[int]) -> None:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=1,
                    min_new_tokens=1,
                    do_sample=False,
                )

        def ours(prompt: list[int]) -> None:
            llm.generate([{"prompt_token_ids": prompt}], params)

        def blas(prompt: list[int]) -> None:
            linear_module._onednn_enabled = lambda: False
            try:
                ours(prompt)
            finally:
                linear_module._onednn_enabled = enabled

        rng = random.Random(0)
        vocab = hf.config.vocab_size
        for r in range(args.rounds):
            for name, fn in (("transformers", peer), ("medha BLAS", blas), ("medha oneDNN", ours)):
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                t0 = os.times()
                fn(prompt)
                t1 = os.times()
                cpu = t1.user - t0.user + t1.system - t0.system
                print(
                    f"round {r} {name:13s} CPU {cpu:.3f} s, load average "
                    f"{os.getloadavg()[0]:.1f} ({time.strftime('%H:%M:%S')})",
                    flush=True,
                )
        llm.shutdown()


if __name__ == "__main__":
    main()
