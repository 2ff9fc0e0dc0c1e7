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
  hands a step's later layers, and the one ``KVPCommunicator.contributor``
  hands a non-sampling group's last layer: its state published, no wait) and
  its shared-memory exchange (the wait for the peer included);
- logits, sampling; the model's forward pass and the whole step.

Prints microseconds of thread CPU per step (the mean) and calls per step, for
kvp=1 and each kvp=2 rank, and the load average before and after.

    python benchmarks/kvp_step_profile.py                  # 32K context, 300 steps
    python benchmarks/kvp_step_profile.py --context 8192 --steps 100
    python benchmarks/kvp_step_profile.py --swap     # rank 0 (the sampler) holds the tail
    python benchmarks/kvp_step_profile.py --ahead    # kvp=2 also with the batch built ahead
    python benchmarks/kvp_step_profile.py --timeline # + each kvp=2 merge's arrivals, per layer

``--timeline`` also stamps (``time.perf_counter``: ``CLOCK_MONOTONIC``, one
clock for both processes) each kvp=2 rank's step start and end, each layer's
local attention start and its merge's entry and exit, and prints per layer
(medians over the steps): which rank reaches the merge last and how much
later (the skew), each rank's wall in the merge when it is first (the wait)
and when it is last (the merge's own work), and each rank's wall from the
previous merge's exit (the step's start for layer 0) to its attention and
to the merge.
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
    timeline: bool = False,
) -> dict:
    """Thread CPU seconds and calls per step, by part, on this rank (with ``timeline``,
    also its stamps per step: ``"timeline"``, see :func:`_timeline_stamps`)."""
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

    # timeline: per step, (tag, perf_counter) in call order; tags by label
    stamps: list[list[tuple[str, float]]] = []
    stamped = {"attention (local)": "attn", "merge (all)": "merge", "STEP": "step"}
    now = time.perf_counter

    def timed(fn: Callable, label: str) -> Callable:
        tag = stamped.get(label) if timeline else None

        @functools.wraps(fn)
        def timed_fn(*args, **kwargs):
            if not on[0]:
                return fn(*args, **kwargs)
            if tag is not None:
                if tag == "step":
                    stamps.append([])
                stamps[-1].append((tag + " in", now()))
            t = clock()
            out = fn(*args, **kwargs)
            used[label] += clock() - t
            calls[label] += 1
            if tag is not None:
                stamps[-1].append((tag + " out", now()))
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
    # a non-sampling group's last layer: its part of the merge, no wait (where it has one)
    wrap_returned(kvp.KVPCommunicator, "contributor", "merge (all)")
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
    return parts | {"wall (median)": (statistics.median(walls), 1.0), "timeline": stamps}


def _timeline_stamps(steps: list[list[tuple[str, float]]]) -> list[dict[str, list[float]]]:
    """Per step of one rank: ``{"step": [in, out], "attn": [layer 0's in, ...],
    "merge in": [...], "merge out": [...]}`` (seconds, ``time.perf_counter``)."""
    out = []
    for events in steps:
        got: dict[str, list[float]] = collections.defaultdict(list)
        for tag, t in events:
            if tag == "step in" or tag == "step out":
                got["step"].append(t)
            elif tag == "attn in":
                got["attn"].append(t)
            elif tag.startswith("merge"):
                got[tag].append(t)
        out.append(dict(got))
    return out


def print_timeline(r0: list, r1: list) -> None:
    """Per layer, medians over the steps: who reaches the merge last, by how much, and
    what each rank's wall goes to (see the module docstring)."""
    a, b = _timeline_stamps(r0), _timeline_stamps(r1)
    n = min(len(a), len(b))
    layers = min(len(s["merge in"]) for s in a[:n] + b[:n])
    med = statistics.median
    us = 1e6
    print(f"\ntimeline: {n} steps, {layers} merges a step; wall us, medians over the steps")
    print(
        f"{'layer':>5} {'r0 late by':>10} {'r0 last':>7} {'|skew|':>7}"
        f" {'wait r0':>8} {'wait r1':>8} {'own r0':>7} {'own r1':>7}"
        f" {'to attn r0':>10} {'to attn r1':>10} {'attn r0':>8} {'attn r1':>8}"
    )
    for layer in range(layers):
        skew, waits, owns = [], ([], []), ([], [])
        pre, att = ([], []), ([], [])
        for s0, s1 in zip(a[:n], b[:n], strict=True):
            arrive = (s0["merge in"][layer], s1["merge in"][layer])
            leave = (s0["merge out"][layer], s1["merge out"][layer])
            skew.append(arrive[0] - arrive[1])
            first = 0 if arrive[0] <= arrive[1] else 1
            waits[first].append(leave[first] - arrive[first])
            owns[1 - first].append(leave[1 - first] - arrive[1 - first])
            for r, st in enumerate((s0, s1)):
                start = st["merge out"][layer - 1] if layer else st["step"][0]
                pre[r].append(st["attn"][layer] - start)
                att[r].append(st["merge in"][layer] - st["attn"][layer])
        late = sum(x > 0 for x in skew) / len(skew)

        def m(xs: list[float]) -> str:
            return f"{us * med(xs):.0f}" if xs else "-"

        print(
            f"{layer:>5} {us * med(skew):>10.0f} {100 * late:>6.0f}% {m([abs(x) for x in skew]):>7}"
            f" {m(waits[0]):>8} {m(waits[1]):>8} {m(owns[0]):>7} {m(owns[1]):>7}"
            f" {m(pre[0]):>10} {m(pre[1]):>10} {m(att[0]):>8} {m(att[1]):>8}"
        )
    tail = ([], [])
    for s0, s1 in zip(a[:n], b[:n], strict=True):
        for r, st in enumerate((s0, s1)):
            tail[r].append(st["step"][1] - st["merge out"][layers - 1])
    gaps = [b[i + 1]["step"][0] - a[i + 1]["step"][0] for i in range(n - 1)]
    print(
        f"after the last merge to the step's end: r0 {us * med(tail[0]):.0f}, r1 "
        f"{us * med(tail[1]):.0f}; r1's step starts after r0's by {us * med(gaps):.0f} "
        f"(median); step wall r0 {us * med(s['step'][1] - s['step'][0] for s in a[:n]):.0f}, "
        f"r1 {us * med(s['step'][1] - s['step'][0] for s in b[:n]):.0f}"
    )


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
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="kvp=2: stamp each merge's arrivals on one clock; print who is late, per layer",
    )
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    walk = False if args.ahead else None
    common = (args.context, args.steps, args.block)
    one = launch(_profile, 1, *common, False, walk)[0]
    runs = [one, *launch(_profile, 2, *common, args.swap, walk, args.timeline)]
    heads = ["kvp=1", "kvp=2 r0", "kvp=2 r1"]
    if args.ahead:
        runs += launch(_profile, 2, *common, args.swap, True, args.timeline)
        heads += ["ahead r0", "ahead r1"]
    print(f"load average after: {os.getloadavg()}")
    timelines = [run.pop("timeline") for run in runs]
    print(f"\none decode step at {args.context} tokens, {args.steps} steps: thread CPU us per step")
    print(f"{'part':>24}" + "".join(f" {h:>15}" for h in heads))
    names = list(dict.fromkeys(k for res in runs[1:] + runs[:1] for k in res))
    for name in names:
        line = f"{name:>24}"
        for res in runs:
            got = res.get(name)
            line += f" {1e6 * got[0]:9.1f} ({got[1]:3.0f})" if got else f" {'-':>15}"
        print(line)
    if args.timeline:
        for i in range(1, len(runs), 2):
            print(f"\n{heads[i]} / {heads[i + 1]}:", end="")
            print_timeline(timelines[i], timelines[i + 1])


if __name__ == "__main__":
    main()
