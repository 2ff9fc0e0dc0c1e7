"""``medha_runtime.LLM`` against ``transformers``' ``generate`` on one checkpoint, side by side.

Both run the same checkpoint in the same dtype (fp32 unless ``--dtype``) with the same torch
thread count, the same prompts (random token ids, equal lengths, no padding),
greedy, EOS ignored. For each batch size:

- decode: the time of ``max_tokens=N`` minus the time of ``max_tokens=1``
  (prefill and the first token cancel), over ``B x (N - 1)`` tokens, as
  tokens/s and ms per step;
- beside it, the machine's bound for one decode step measured in the same run:
  the weights' bytes over the measured read bandwidth, or the step's FLOPs
  over the measured fp32 matmul rate, whichever is larger.

Then the prefill of one ``--prefill``-token prompt (``max_tokens=1``).

The checkpoint defaults to a random one of SmolLM2-135M's shape written by
``transformers`` (``save_pretrained``) into a temporary directory. ``--model``
takes what ``LLM`` takes: a Hugging Face directory, a ``.gguf`` file, or
``smollm2`` (SmolLM2-135M-Instruct itself, fetched once). A GGUF is read by
both sides and dequantized to ``--dtype`` (``transformers`` through
``from_pretrained(dir, gguf_file=...)``), so both run the same weights.

``--repeats N`` times each side N times, alternating (transformers, then each
engine mode), and reports the medians with the range of the ratios: on a
shared machine one timing of each is a coin toss at the margins.

``--modes sync async graphs async-graphs`` times one engine per mode (async
scheduling, CUDA graphs for decode steps, both) on the same checkpoint, beside the one
``transformers`` run. ``--device cuda --dtype bfloat16`` runs all of it on a GPU
(the bound then uses the measured device copy rate and bf16 matmul rate).

    python benchmarks/engine_vs_transformers.py                       # batches 1, 8, 32
    python benchmarks/engine_vs_transformers.py --batches 8 --new 16  # quicker
    python benchmarks/engine_vs_transformers.py --threads 1 --cpu-time  # on a busy machine
    python benchmarks/engine_vs_transformers.py --model smollm2 --repeats 3  # the real model
    python benchmarks/engine_vs_transformers.py --device cuda --dtype bfloat16 --modes sync async
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_checkpoint(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(directory)
    return directory


CLOCK = time.perf_counter  # or time.process_time (--cpu-time)


def machine_rates(threads: int, device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(read bytes/s, matmul FLOP/s in ``dtype``) measured now on ``device`` (CPU: with
    ``threads`` threads, a sum's read rate; CUDA: a device-to-device copy's read rate)."""
    torch.set_num_threads(threads)
    if device == "cuda":
        return _cuda_rates(dtype)
    clock = CLOCK
    x = torch.ones(64 * 2**20 // 4 * 8)  # 512 MiB
    best_bw = 0.0
    for _ in range(5):
        t0 = clock()
        x.sum()
        best_bw = max(best_bw, x.numel() * 4 / (clock() - t0))
    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    best_mm = 0.0
    for _ in range(10):
        t0 = clock()
        a @ b
        best_mm = max(best_mm, 2 * 1024**3 / (clock() - t0))
    return best_bw, best_mm


def _cuda_rates(dtype: torch.dtype) -> tuple[float, float]:
    """(bytes/s read by a 1 GiB device copy, matmul FLOP/s of 8192^3 in ``dtype``), best of 5."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=dtype, device="cuda")
    b = torch.randn(8192, 8192, dtype=dtype, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    bw = src.numel() / best(lambda: dst.copy_(src))
    mm = 2 * 8192**3 / best(lambda: a @ b)
    return bw, mm  # the 2 GiB of buffers go back to torch's cache on return


def step_bound(c: dict, batch: int, context: int, bw: float, mm: float, elem: int = 4) -> float:
    """Seconds one decode step of ``batch`` needs at least on this machine, with
    ``elem``-byte weights and KV (``c``: the model's Hugging Face config as a dict)."""
    h, ffn, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn
    params = layers * per_layer + c["vocab_size"] * h
    flops = 2 * params * batch + 4 * layers * q * context * batch
    kv_bytes = 2 * layers * kv * context * batch * elem
    return max((params * elem + kv_bytes) / bw, flops / mm)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_hf(model, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    _sync()
    t0 = CLOCK()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    _sync()
    elapsed = CLOCK() - t0
    assert out.shape[1] == ids.shape[1] + new
    return elapsed


def time_llm(llm, prompts: list[list[int]], new: int) -> float:
    from medha_runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = CLOCK()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = CLOCK() - t0
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face directory, a .gguf file or smollm2 (default: a random checkpoint "
        "of SmolLM2-135M's shape)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timings of each side, alternating; medians"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=32, help="new tokens per request")
    parser.add_argument("--prefill", type=int, default=2048, help="prefill prompt length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("sync", "async", "graphs", "async-graphs"),
        default=["sync"],
        help="the engine's modes, each timed: sync, async (async_scheduling=True), graphs "
        "(cuda_graphs=True), async-graphs (both)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="the engine's fixed prefill chunk (0: whole prompts); default: adaptive chunking",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time (needs --threads 1): on a busy shared "
        "machine it leaves out the time other processes hold the core",
    )
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1 or args.device != "cpu":
            parser.error("--cpu-time needs --threads 1 on the CPU (CPU time adds up every thread)")
        global CLOCK
        CLOCK = time.process_time
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    from medha_runtime import LLM

    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_checkpoint(Path(tmp) / "ckpt"))
        torch.set_num_threads(args.threads)
        model, hf = load_peer(model, dtype)
        hf = hf.to(args.device).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        config = hf.config.to_dict()
        most = max(args.batches) * (args.prompt + args.new)
        # at least 2,064 whatever --prefill: the automatic budget follows max_model_len,
        # and a short one (96 with --prefill 64) changed the steps
        max_len = max(args.prefill, args.prompt + args.new, 2048) + 16
        engines = {
            mode: LLM(
                model,
                dtype=args.dtype,
                device=args.device,
                max_model_len=max_len,
                kv_cache_tokens=max(most, max_len) + 1024,
                num_threads=args.threads,
                async_scheduling=mode.startswith("async"),
                cuda_graphs=mode.endswith("graphs"),
                **({} if args.chunk_size is None else {"chunk_size": args.chunk_size}),
            )
            for mode in args.modes
        }
        bw, mm = machine_rates(args.threads, args.device, dtype)
        print(
            f"{model}: device {args.device} ({_device_name(args.device)}), {args.dtype}, "
            f"load average {os.getloadavg()[0]:.1f}, chunk size {args.chunk_size}, "
            f"threads {torch.get_num_threads()}, read {bw / 1e9:.1f} GB/s, "
            f"matmul {mm / 1e9:.0f} GFLOP/s, {args.repeats} repeat(s)"
        )
        rng = random.Random(0)
        vocab = hf.config.vocab_size
        for batch in args.batches:
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(batch)]
            time_hf(hf, prompts, 2)  # warm-up
            for llm in engines.values():
                time_llm(llm, prompts, args.new)  # warm-up: every CUDA graph it needs captured
            timers = {"transformers": partial(_decode_time, time_hf, hf, prompts, args.new)}
            for mode, llm in engines.items():
                timers[mode] = partial(_decode_time, time_llm, llm, prompts, args.new)
            times = _alternate(args.repeats, timers)
            steps = args.new - 1
            bound = step_bound(config, batch, args.prompt + args.new // 2, bw, mm, elem)
            peer = statistics.median(times["transformers"])
            for mode in engines:
                ours = statistics.median(times[mode])
                print(
                    f"decode batch {batch:3d} [{mode:12s}]: medha {batch * steps / ours:8.1f} "
                    f"tok/s ({ours / steps * 1e3:6.2f} ms/step), transformers "
                    f"{batch * steps / peer:8.1f} tok/s ({peer / steps * 1e3:6.2f} ms/step), "
                    f"ratio {peer / ours:.2f}x{_spread(times, mode)}; bound "
                    f"{bound * 1e3:.2f} ms/step (medha at {bound / (ours / steps):.0%})",
                    flush=True,
                )
        # a fresh prompt for each repeat (the same for every side): a repeated one would
        # hit the engine's prefix cache
        fresh = [
            [[rng.randrange(3, vocab) for _ in range(args.prefill)]] for _ in range(args.repeats)
        ]
        timers = {"transformers": partial(_prefill_time, time_hf, hf, fresh)}
        for mode, llm in engines.items():
            timers[mode] = partial(_prefill_time, time_llm, llm, fresh)
        times = _alternate(args.repeats, timers)
        peer = statistics.median(times["transformers"])
        for mode in engines:
            ours = statistics.median(times[mode])
            print(
                f"prefill {args.prefill} [{mode}]: medha {ours:.3f} s, transformers {peer:.3f} s, "
                f"ratio {peer / ours:.2f}x{_spread(times, mode)}; load average "
                f"{os.getloadavg()[0]:.1f}"
            )
        for llm in engines.values():
            llm.shutdown()


def load_peer(model: str, dtype: torch.dtype):
    """(the path ``LLM`` gets, ``transformers``' model of it in ``dtype``): a Hugging Face
    directory as is, a GGUF (or ``smollm2``) through ``gguf_file``, dequantized."""
    from transformers import AutoModelForCausalLM

    from medha_runtime.model.names import resolve_model

    resolved = resolve_model(model)
    if resolved.kind == "hf":
        return resolved.path, AutoModelForCausalLM.from_pretrained(resolved.path, dtype=dtype)
    if resolved.kind == "gguf":
        file = Path(resolved.path)
        hf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=dtype)
        return resolved.path, hf
    raise SystemExit(f"--model {model}: transformers cannot load a {resolved.kind} model")


def _decode_time(time_fn, model, prompts: list[list[int]], new: int, round_: int) -> float:
    """Seconds of ``new - 1`` decode steps: ``new`` tokens' time minus one token's."""
    return time_fn(model, prompts, new) - time_fn(model, prompts, 1)


def _prefill_time(time_fn, model, prompts: list[list[list[int]]], round_: int) -> float:
    """Seconds to prefill round ``round_``'s prompt and sample one token."""
    return time_fn(model, prompts[round_], 1)


def _alternate(repeats: int, timers: dict) -> dict[str, list[float]]:
    """Each timer (``timer(round)`` -> seconds) once a round, in turn, ``repeats`` rounds:
    ``{name: [s...]}``."""
    times: dict[str, list[float]] = {name: [] for name in timers}
    for round_ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer(round_))
    return times


def _spread(times: dict[str, list[float]], mode: str) -> str:
    """`` (repeats lo-hix)``: the range of each repeat's transformers / medha time, or
    nothing for one repeat."""
    ratios = [p / o for p, o in zip(times["transformers"], times[mode], strict=True)]
    if len(ratios) < 2:
        return ""
    return f" (repeats {min(ratios):.2f}-{max(ratios):.2f}x)"


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
