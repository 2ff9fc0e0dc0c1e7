"""One model decode step on the CPU: ``B`` requests, SmolLM2-135M's shape, random weights.

Builds :class:`medha_runtime.model.LlamaModel` at SmolLM2-135M's shape (30
layers, hidden 576, 9 query / 3 KV heads of 64, vocabulary 49,152, tied
embeddings) with random fp32 weights, prefills ``--batch`` prompts of
``--context`` tokens into a paged KV cache (shuffled blocks of 16), then times
``--steps`` decode steps of all of them. A step is what the runner pays: build
the :class:`~medha_runtime.model.ForwardBatch` from Python lists, then run the
forward pass to the logits. Prints the median step time and the time spent in
the layers' attention hook (summed over the 30 layers).

The attention goes through :class:`medha_runtime.model.llama.PagedAttention`
with ``--backend`` (default ``auto``). To compare with an older tree, run this
file with ``PYTHONPATH=<that tree>/src``: it only uses APIs both have.

    python benchmarks/decode_step.py --batch 8 --context 256
    python benchmarks/decode_step.py --batch 8 --backend torch
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import medha_kernels
from medha_runtime.model import ForwardBatch, LlamaModel
from medha_runtime.model.config import ModelConfig
from medha_runtime.model.llama import PagedAttention

SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_layers": 30,
    "num_q_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
BLOCK = 16


class TimedAttention:
    """Wraps the layers' attention hook and adds up the seconds spent in it."""

    def __init__(self, inner: PagedAttention, clock) -> None:
        self.inner = inner
        self.clock = clock
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = self.clock()
        out = self.inner(*args, **kwargs)
        self.seconds += self.clock() - t0
        return out


def build_model(seed: int) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(ModelConfig(**SMOLLM2_135M), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="the process's CPU time instead of the wall clock (with --threads 1 on a busy "
        "machine: leaves out the time other processes hold the core)",
    )
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    model = build_model(0)
    attention = TimedAttention(PagedAttention(args.backend), clock)
    model.set_attention(attention)
    total = args.context + args.steps + 1
    per_seq = -(-total // BLOCK)
    ids = list(range(args.batch * per_seq))
    random.Random(0).shuffle(ids)
    blocks = [ids[b * per_seq : (b + 1) * per_seq] for b in range(args.batch)]
    kv = model.allocate_kv_cache(args.batch * per_seq, BLOCK)
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(args.context)] for _ in range(args.batch)]
    for b in range(args.batch):  # prefill one request at a time
        batch = ForwardBatch.build([prompts[b]], [0], [blocks[b]], block_size=BLOCK)
        logits = model(batch, kv)
        prompts[b].append(int(logits[-1].argmax()))
    times, attn = [], []
    for step in range(args.steps):
        start = [args.context + step] * args.batch
        attention.seconds = 0.0
        t0 = clock()
        batch = ForwardBatch.build([[p[-1]] for p in prompts], start, blocks, block_size=BLOCK)
        logits = model(batch, kv)
        times.append(clock() - t0)
        attn.append(attention.seconds)
        for b in range(args.batch):
            prompts[b].append(int(logits[b].argmax()))
    steady = times[2:] if len(times) > 4 else times
    steady_attn = attn[2:] if len(attn) > 4 else attn
    mode = "CPU time" if args.cpu_time else "wall clock"
    print(
        f"medha_kernels from {medha_kernels.__file__}\n"
        f"decode step, batch {args.batch}, context {args.context}, {args.threads} threads, "
        f"backend {args.backend}, {mode}: median {statistics.median(steady) * 1e3:.1f} ms, "
        f"min {min(steady) * 1e3:.1f} ms over {len(steady)} steps; attention (all layers) "
        f"median {statistics.median(steady_attn) * 1e3:.1f} ms, min {min(steady_attn) * 1e3:.1f} ms"
    )
    print("tokens:", [p[args.context : args.context + 4] for p in prompts[:2]])


if __name__ == "__main__":
    main()
