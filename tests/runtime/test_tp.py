"""TP2 on gloo: each rank loads its shard; greedy tokens as one process, logits within 2x.

One launch covers a transformers checkpoint (sharded safetensors, GQA 4/2)
and the tiny model (vocabulary 259, padded to 260 over two ranks).
"""

from __future__ import annotations

from pathlib import Path

import torch

from medha_parallel import ParallelLayout, ParallelState, TPCommunicator
from medha_runtime.model import ForwardBatch, load_model
from medha_runtime.model.tiny import save_tiny
from tests.numerics import assert_twice_torch
from tests.parallel.dist import launch
from tests.runtime.checkpoints import greedy, hf_logits

# 24 tokens: the prefill's MLP runs the fused SwiGLU kernel (17-32 rows) on each shard
PROMPT = [1, 17, 42, 5, 88, 23, 61, 9, 70, 33, 14, 50, 3, 77, 2, 64, 11, 29, 95, 40, 7, 58, 36, 12]


def _run(path: str | Path, tp: TPCommunicator | None) -> dict:
    model, _ = load_model(path, dtype="float32", tp=tp)
    batch = ForwardBatch.build([PROMPT], [0], [[3, 1, 0, 2, 5, 4]], block_size=4)
    batch.sample_rows = torch.arange(len(PROMPT))
    return {
        "logits": model(batch, model.allocate_kv_cache(6, 4)),
        "greedy": greedy(model, PROMPT, 8, chunk=5),
        "qkv_rows": model.layers["0"].self_attn.qkv_proj.weight.shape[0],
    }


def _worker(rank: int, world_size: int, init: str, paths: list[str]) -> dict:
    state = ParallelState.initialize(
        ParallelLayout(tp=world_size),
        backend="gloo",
        init_method=init,
        rank=rank,
        world_size=world_size,
    )
    comm = TPCommunicator(state)
    return {p: _run(p, comm) for p in paths}


def test_tp2_matches_one_process(checkpoint, tmp_path) -> None:
    """TP2's fp32 logits are within twice one process's error of transformers' float64."""
    paths = [str(checkpoint("gqa-llama3-tied-sharded")), "tiny"]
    ranks = launch(_worker, 2, paths, timeout=120)
    for path in paths:
        single = _run(path, None)
        hf_dir = save_tiny(tmp_path / "tiny") if path == "tiny" else Path(path)
        truth = hf_logits(hf_dir, PROMPT, torch.float64)
        for res in ranks:
            got = res[path]
            assert got["qkv_rows"] * 2 == single["qkv_rows"]  # each rank holds half the heads
            assert_twice_torch(got["logits"], truth, single["logits"], what=f"{path} TP2 logits")
            assert got["greedy"] == single["greedy"], path
