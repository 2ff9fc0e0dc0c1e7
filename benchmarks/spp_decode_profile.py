"""Where one decode step's time goes, per pipeline stage, ``spp=2`` beside ``spp=1``.

The run of :mod:`benchmarks.spp_pipeline` (one ``--context``-token prompt on
``tiny``, greedy, ``--new`` output tokens, one torch thread per rank), with
timers around the parts of a step on every rank and in the driver: thread CPU
and wall microseconds per decode step (medians over the decode steps; the parts
nest, ``execute`` holds the ones indented under it). Worker processes get
their timers through a wrapper of the worker's entry point
(:func:`medha_runtime.worker.pipe_worker_main`), which writes the rank's
figures to a file when the driver shuts it down.

    python benchmarks/spp_decode_profile.py                 # 8K-token prompt
    python benchmarks/spp_decode_profile.py --context 2048 --new 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

#: (owner, attribute, label, depth): what gets a timer, in report order
PARTS = [
    ("medha_runtime.transport:PipeTransport", "recv", "recv Step (unpickle)", 0),
    ("medha_runtime.runner:ModelRunner", "execute", "execute", 0),
    ("medha_runtime.runner", "build_group_batch", "build batch", 1),
    ("medha_runtime.model.batch:ForwardBatch", "prepare_kv_write", "prepare KV write", 1),
    ("medha_runtime.model.batch:ForwardBatch", "attention_plan", "attention plan", 1),
    ("medha_runtime.stage:PipelineStage", "micro_batch", "hand-off header", 1),
    ("medha_parallel.spp:SPPCommunicator", "recv_chunk", "recv hidden (incl. wait)", 1),
    ("medha_runtime.model.llama:LlamaModel", "forward", "model layers", 1),
    ("medha_parallel.spp:SPPCommunicator", "send_chunk", "send hidden", 1),
    ("medha_runtime.runner", "sample_step", "sample", 1),
    ("medha_runtime.transport:PipeTransport", "send", "reply Done", 0),
]
DRIVER_PARTS = [
    ("medha_runtime.engine:LLMEngine", "_issue", "driver: schedule+plan+submit", 0),
    ("medha_runtime.executor:MultiprocExecutor", "submit", "driver: submit (pickle, pipes)", 1),
    ("medha_runtime.executor:MultiprocExecutor", "next_event", "driver: next_event (wait)", 0),
    ("medha_runtime.engine:LLMEngine", "_end_batch", "driver: end batch", 0),
]


class Timers:
    """Thread CPU and wall seconds per (step, label), for the steps marked decode."""

    def __init__(self) -> None:
        self.step: int | None = None  # the decode step being run (None: not a decode)
        self.cpu: dict[str, dict[int, float]] = defaultdict(dict)
        self.wall: dict[str, dict[int, float]] = defaultdict(dict)
        self.stamps: dict[str, dict[int, float]] = {}

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.add(label, time.thread_time() - c0, time.perf_counter() - w0)
                timers.stamp(label + " returned")

        setattr(owner, attr, timed)

    def add(self, label: str, cpu: float, wall: float) -> None:
        if self.step is None:
            return
        self.cpu[label][self.step] = self.cpu[label].get(self.step, 0.0) + cpu
        self.wall[label][self.step] = self.wall[label].get(self.step, 0.0) + wall

    def stamp(self, label: str, _: Any = None) -> None:
        """A ``time.perf_counter`` stamp (one clock for every process on the host)."""
        if self.step is not None:
            self.stamps.setdefault(label, {})[self.step] = time.perf_counter()

    def medians(self) -> dict[str, tuple[float, float]]:
        steps = set().union(*(d.keys() for d in self.cpu.values())) if self.cpu else set()
        out = {}
        for label in self.cpu:
            cpu = [self.cpu[label].get(s, 0.0) for s in steps]
            wall = [self.wall[label].get(s, 0.0) for s in steps]
            out[label] = (statistics.median(cpu), statistics.median(wall))
        return out


def _resolve(path: str) -> Any:
    import importlib

    module, _, cls = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, cls) if cls else mod


def instrument(parts: list, timers: Timers, decode: Callable[[Any], int | None]) -> None:
    """Put a timer on each part; ``decode(plan)`` gives the step id to count or None."""
    for owner, attr, label, _ in parts:
        if label in ("recv Step (unpickle)", "execute"):
            continue
        timers.wrap(_resolve(owner), attr, label)
    from medha_runtime.runner import ModelRunner

    execute = ModelRunner.execute

    from medha_runtime.model.llama import LlamaModel

    forward = LlamaModel.forward

    def forward_stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        timers.stamp("layers start")
        try:
            return forward(self, *args, **kwargs)
        finally:
            timers.stamp("layers done")

    LlamaModel.forward = forward_stamped  # type: ignore[method-assign]

    def execute_timed(self: Any, plan: Any) -> Any:
        timers.step = decode(plan)
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return execute(self, plan)
        finally:
            timers.add("execute", time.thread_time() - c0, time.perf_counter() - w0)
            timers.stamp("execute done")

    ModelRunner.execute = execute_timed  # type: ignore[method-assign]


def _decode_step(plan: Any) -> int | None:
    return plan.step_id if plan.num_tokens == 1 and plan.step_id >= 0 else None


def profiled_worker(rank: int, spec: Any, init_method: str, conn: Any) -> None:
    """:func:`medha_runtime.worker.pipe_worker_main` with the timers on; the rank's
    medians go to ``$SPP_PROFILE_DIR/rank<rank>.json`` at shutdown."""
    from medha_runtime import transport, worker

    timers = Timers()
    instrument(PARTS, timers, _decode_step)
    recv = transport.PipeTransport.recv

    def recv_timed(self: Any) -> Any:
        c0, w0 = time.thread_time(), time.perf_counter()
        msg = recv(self)
        plan = getattr(msg, "plan", None)
        timers.step = None if plan is None else _decode_step(plan)
        timers.add("recv Step (unpickle)", time.thread_time() - c0, time.perf_counter() - w0)
        timers.stamp("Step in hand")
        return msg

    send = transport.PipeTransport.send

    def send_timed(self: Any, msg: Any) -> None:
        timers.stamp("reply posted", send(self, msg))

    transport.PipeTransport.send = send_timed  # type: ignore[method-assign]

    transport.PipeTransport.recv = recv_timed  # type: ignore[method-assign]
    try:
        worker.pipe_worker_main(rank, spec, init_method, conn)
    finally:
        path = os.path.join(os.environ["SPP_PROFILE_DIR"], f"rank{rank}.json")
        with open(path, "w") as f:
            json.dump({"medians": timers.medians(), "stamps": timers.stamps}, f)


def run(spp: int, prompt: list[int], new: int, chunk: int) -> dict[str, dict]:
    """Run the request on ``spp`` stages; {"driver" or "rank<r>": {label: (cpu s, wall s)}}."""
    from medha_runtime import SamplingParams
    from medha_runtime.engine import LLMEngine
    from medha_sched import AffineCostModel

    timers = Timers()
    engine = LLMEngine(
        "tiny",
        spp=spp,
        async_scheduling=False,  # the synchronous step, part by part (spp > 1 defaults to async)
        num_threads=1,
        max_model_len=len(prompt) + new + 16,
        kv_cache_tokens=len(prompt) + new + 64,
        chunk_size=chunk,
        policy="fcfs",
        cost_model=AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9),
    )
    decoding = [False]
    if spp == 1:
        instrument(PARTS, timers, _decode_step)
    parts = DRIVER_PARTS if spp > 1 else [p for p in DRIVER_PARTS if "Multiproc" not in p[0]]
    if spp == 1:  # the in-process executor's wait for the model thread
        parts = [
            *parts,
            (
                "medha_runtime.executor:InProcessExecutor",
                "next_event",
                "driver: next_event (wait)",
                0,
            ),
        ]
    driver = Timers()
    for owner, attr, label, _ in parts:
        driver.wrap(_resolve(owner), attr, label)
    stamps: dict[str, dict[int, float]] = {}
    ex = engine.executor
    submit, next_event = ex.submit, ex.next_event

    def submit_stamped(plan: Any) -> None:
        decode = _decode_step(plan) is not None
        if decode:
            stamps.setdefault("driver: submit", {})[plan.step_id] = time.perf_counter()
        submit(plan)
        if decode:
            stamps.setdefault("driver: submitted", {})[plan.step_id] = time.perf_counter()

    def next_event_stamped() -> Any:
        event = next_event()
        label = "driver: " + type(event).__name__
        stamps.setdefault(label, {})[event.step_id] = time.perf_counter()
        return event

    ex.submit, ex.next_event = submit_stamped, next_event_stamped
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    step = 0
    walls = []
    try:
        while engine.has_unfinished_requests():
            progress = engine.progress(rid)
            decoding[0] = progress is not None and len(progress.output_ids) > 0
            driver.step = step if decoding[0] else None
            w0 = time.perf_counter()
            engine.step()
            if decoding[0]:
                walls.append(time.perf_counter() - w0)
            step += 1
    finally:
        engine.shutdown()
        for owner, attr, *_ in parts:  # undo the driver's timers (the next run makes new ones)
            obj = _resolve(owner)
            fn = getattr(obj, attr)
            if fn.__closure__:
                setattr(obj, attr, fn.__closure__[0].cell_contents)
    out: dict[str, Any] = {"driver": driver.medians(), "stamps": {"driver": stamps}}
    out["driver"]["engine.step (wall)"] = (0.0, statistics.median(walls))
    if spp == 1:
        out["rank0"] = timers.medians()
        out["stamps"]["rank0"] = timers.stamps
    return out


def timeline(stamps: dict[str, dict[str, dict[int, float]]]) -> list[tuple[str, float]]:
    """Median offsets (s) of every stamp from the driver's submit of the same decode step."""
    base = stamps["driver"]["driver: submit"]
    rows = []
    for who, d in stamps.items():
        for label, by_step in d.items():
            steps = [s for s in by_step if s in base]
            if not steps:
                continue
            off = statistics.median(by_step[s] - base[s] for s in steps)
            name = label if who == "driver" else f"{who}: {label}"
            rows.append((name, off))
    return sorted(rows, key=lambda r: r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompt = [rng.randrange(0, 256) for _ in range(args.context)]
    load0 = os.getloadavg()
    spp1 = run(1, prompt, args.new, args.chunk)
    import medha_runtime.worker as worker

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SPP_PROFILE_DIR"] = tmp
        worker.pipe_worker_main = profiled_worker  # type: ignore[assignment]
        spp2 = run(2, prompt, args.new, args.chunk)
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                got = json.load(f)
            spp2[f"rank{r}"] = {k: tuple(v) for k, v in got["medians"].items()}
            spp2["stamps"][f"rank{r}"] = {
                k: {int(s): t for s, t in v.items()} for k, v in got["stamps"].items()
            }
    load1 = os.getloadavg()
    print(
        f"context {args.context}, {args.new} new tokens; load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after; medians per decode step, us CPU / us wall"
    )
    cols = [
        ("spp1", spp1["rank0"]),
        ("spp2 stage 0", spp2["rank0"]),
        ("spp2 stage 1", spp2["rank1"]),
    ]
    print(f"{'part':34s}" + "".join(f"{name:>20s}" for name, _ in cols))
    for _, _, label, depth in PARTS:
        row = "  " * depth + label
        cells = []
        for _, d in cols:
            v = d.get(label)
            cells.append("-" if v is None else f"{1e6 * v[0]:.0f} / {1e6 * v[1]:.0f}")
        print(f"{row:34s}" + "".join(f"{c:>20s}" for c in cells))
    print()
    labels = [p[2] for p in DRIVER_PARTS] + ["engine.step (wall)"]
    print(f"{'driver part':34s}{'spp1':>20s}{'spp2':>20s}")
    for label in labels:
        cells = []
        for d in (spp1["driver"], spp2["driver"]):
            v = d.get(label)
            cells.append("-" if v is None else f"{1e6 * v[0]:.0f} / {1e6 * v[1]:.0f}")
        print(f"{label:34s}" + "".join(f"{c:>20s}" for c in cells))
    for name, run_ in (("spp1", spp1), ("spp2", spp2)):
        print(f"\n{name}: one decode step, us after the driver's submit (medians)")
        for label, off in timeline(run_["stamps"]):
            print(f"  {1e6 * off:8.0f}  {label}")


if __name__ == "__main__":
    main()
