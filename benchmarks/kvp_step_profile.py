"""Where a KVP rank's decode step goes: thread CPU per part, kvp=1 against kvp=2.

One decode step at the end of a ``--context``-token sequence on ``tiny`` (as
``kvp_decode.py --ranks --modes sync``: the row sampled greedily, KV of
zeros), run ``--steps`` times by ``ModelRunner`` s (kvp=1: one process;
kvp=2: two joined over gloo, forkserver, ``file://``, the shared-memory
merge; one torch thread each). The parts are timed by wrapping the functions
that do them with the thread CPU clock (each wrapped call adds ~1-2 us):

- batch build (``build_group_batch``), ``prepare_kv_write``, embedding,
  rotary tables;
- per layer: RMSNorm, the linear layers, rotary, the KV write, the
  attention plan (the step's first layer), the local attention over this
  rank's shard (``PagedAttentionPlan.run``, and its ``unchecked_run`` that a
  KVP step's later layers call), the merge
  (``KVPCommunicator.merge``, and the callable ``KVPCommunicator.merger``
  hands a step's later layers) and its shared-memory exchange (the wait for
  the peer included);
- logits, sampling; the model's forward pass and the whole step.

Prints microseconds of thread CPU per step (the mean) and calls per step, for
kvp=1 and each kvp=2 rank, and the load average before and after.

    python benchmarks/kvp_step_profile.py                  # 32K context, 300 steps
    python benchmarks/kvp_step_profile.py --context 8192 --steps 100
    python benchmarks/kvp_step_profile.py --swap     # rank 0 (the sampler) holds the tail
    python benchmarks/kvp_step_profile.py --ahead    # kvp=2 also with the batch built ahead
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the launch harness: tests/
from tests.parallel.dist import launch


def _profile(
    rank: int,
    world: int,
    init: str,
    context: int,
    steps: int,
    block: int,
    swap: bool = False,
    ahead: bool | None = None,
) -> dict:
    """Thread CPU seconds and calls per step, by part, on this rank."""
    import medha_parallel.kvp as kvp
    import medha_parallel.linear as linear
    import medha_parallel.shm as shm
    from medha_kernels import PagedAttentionPlan
    from medha_parallel import KVPCommunicator, ParallelLayout, ParallelState
    from medha_runtime import runner as runner_mod
    from medha_runtime.model import batch as batch_mod
    from medha_runtime.model import llama, rope
    from medha_runtime.plan import PlannedChunk, StepPlan
    from medha_runtime.runner import ModelRunner, RunnerSpec
    from medha_runtime.sampling_params import SampleSpec

    torch.set_num_threads(1)
    used: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    on = [False]
    clock = time.thread_time

    def timed(fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            if not on[0]:
                return fn(*args, **kwargs)
            t = clock()
            out = fn(*args, **kwargs)
            used[label] += clock() - t
            calls[label] += 1
            return out

        return timed_fn

    def wrap(owner: object, name: str, label: str) -> None:
        setattr(owner, name, timed(getattr(owner, name), label))

    for owner, name, label in (
        (runner_mod, "build_group_batch", "batch build"),
        (batch_mod.ForwardBatch, "prepare_kv_write", "prepare_kv_write"),
        (llama.VocabParallelEmbedding, "forward", "embedding"),
        *(
            [(rope.RotaryEmbedding, "tables", "rotary tables")]
            if hasattr(rope.RotaryEmbedding, "tables")
            else [(llama, "rotary_tables", "rotary tables")]
        ),
        (llama.RMSNorm, "forward", "rmsnorm"),
        *(
            [(llama.RMSNorm, "forward_add", "rmsnorm")]
            if hasattr(llama.RMSNorm, "forward_add")
            else []
        ),
        (linear.ColumnParallelLinear, "forward", "linear"),
        (linear.RowParallelLinear, "forward", "linear"),
        (llama, "apply_rotary_", "rotary"),
        (batch_mod.ForwardBatch, "write_kv", "KV write"),
        (batch_mod.ForwardBatch, "attention_plan", "attention plan"),
        (kvp, "plan_kvp_attention", "attention plan"),
        (PagedAttentionPlan, "run", "attention (local)"),
        (kvp.KVPCommunicator, "merge", "merge (all)"),
        (shm.ShmAllGather, "exchange", "merge: exchange + wait"),
        (llama.LlamaModel, "compute_logits", "logits"),
        (runner_mod, "sample_step", "sampling"),
        (llama.LlamaModel, "forward", "model forward"),
    ):
        wrap(owner, name, label)

    def wrap_returned(owner: object, name: str, label: str) -> None:
        """Time the callable that ``owner.name`` returns (None passes) under ``label``."""
        if not hasattr(owner, name):  # an older checkout
            return
        get = getattr(owner, name)

        def timed_getter(self, *args, **kwargs):
            fn = get(self, *args, **kwargs)
            return None if fn is None else timed(fn, label)

        setattr(owner, name, timed_getter)

    # a step's later layers: the merge and the attention call resolved by its first layer
    wrap_returned(kvp.KVPCommunicator, "merger", "merge (all)")
    wrap_returned(PagedAttentionPlan, "unchecked_run", "attention (local)")
    group = -(-context // world // block) * block
    spec = RunnerSpec(
        model="tiny",
        dtype="float32",
        device="cpu",
        kvp=world,
        num_blocks=group // block + 1,
        block_size=block,
        group_tokens=group,
    )
    state = None
    if world > 1:
        state = ParallelState.initialize(
            ParallelLayout(kvp=world), init_method=init, rank=rank, world_size=world, device="cpu"
        )
    runner = ModelRunner(spec, state)
    if runner.attention is not None:
        runner.attention.comm = KVPCommunicator(state, shared_memory=True)
    groups = tuple(range(world))[::-1] if swap else tuple(range(world))
    blocks = tuple((g, tuple(range(group // block))) for g in groups)
    sample = SampleSpec("a", 0.0, 0, 1.0, 0, None)
    # ahead given: the decodes walk to the context's end, one position a step (the last
    # steps of a generation), and with ahead=True each is built while the rank is idle
    # (ModelRunner.prepare_next after the step, as the worker loop does: not timed)
    first = context - 1 - (steps + 20 if ahead is not None else 0)
    runner.execute(StepPlan(0, (PlannedChunk("a", first, (7,), groups, blocks, sample),)))
    pos = first + 1 if ahead is not None else first
    if ahead:
        runner.prepare_next()
    walls = []
    for i in range(steps + 20):
        if i == 20:
            wrap(ModelRunner, "execute", "STEP")
            on[0] = True
        t = time.perf_counter()
        runner.execute(StepPlan(1, (PlannedChunk("a", pos, (7,), groups, (), sample),)))
        if on[0]:
            walls.append(time.perf_counter() - t)
        if ahead:
            on[0] = False
            runner.prepare_next()
            on[0] = i >= 20
        if ahead is not None:
            pos += 1
    on[0] = False
    if ahead:
        parts_ahead = runner.steps_ahead
        assert parts_ahead == steps + 20, f"{parts_ahead} of {steps + 20} steps built ahead"
    parts = {k: (v / steps, calls[k] / steps) for k, v in used.items()}
    return parts | {"wall (median)": (statistics.median(walls), 1.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument(
        "--ahead",
        action="store_true",
        help="the decodes walk one position a step; kvp=2 also with each step's batch "
        "built ahead (ModelRunner.prepare_next, untimed), both runs side by side",
    )
    ap.add_argument(
        "--swap",
        action="store_true",
        help="kvp=2: rank 1 holds the prefix, rank 0 (the sampler) the tail",
    )
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    walk = False if args.ahead else None
    one = launch(_profile, 1, args.context, args.steps, args.block, False, walk)[0]
    runs = [one, *launch(_profile, 2, args.context, args.steps, args.block, args.swap, walk)]
    heads = ["kvp=1", "kvp=2 r0", "kvp=2 r1"]
    if args.ahead:
        runs += launch(_profile, 2, args.context, args.steps, args.block, args.swap, True)
        heads += ["ahead r0", "ahead r1"]
    print(f"load average after: {os.getloadavg()}")
    print(f"\none decode step at {args.context} tokens, {args.steps} steps: thread CPU us per step")
    print(f"{'part':>24}" + "".join(f" {h:>15}" for h in heads))
    names = list(dict.fromkeys(k for res in runs[1:] + runs[:1] for k in res))
    for name in names:
        line = f"{name:>24}"
        for res in runs:
            got = res.get(name)
            line += f" {1e6 * got[0]:9.1f} ({got[1]:3.0f})" if got else f" {'-':>15}"
        print(line)


if __name__ == "__main__":
    main()
