"""Measuring iteration times: the start-up affine calibration and ``medha-runtime profile``.

Both time *synthetic* steps through the real executor (every rank, every
collective, the driver round trip included): a step of requests that exist
only for it, whose KV blocks are taken straight from the pool (the scheduler
has allocated nothing yet) and released after the step. Their cached KV is
garbage, which does not change the time. Every synthetic request is a tail
request on KVP group 0 and samples one token (greedy), as real steps do.

- :func:`calibrate_affine` fits ``AffineCostModel(base, per_token, per_attn)``
  to a handful of steps; ``LLM`` uses it when no cost model is given.
- :func:`run_profile` measures a grid (prefill chunk size x KV length for one
  request, decode batch size x KV length), fits a
  ``medha_sched.TableCostModel`` (``TableCostModel.fit``) and compares a
  ``RooflineCostModel`` built from the model's actual shape and this
  device's measured FLOP/s, memory bandwidth and per-op overhead (or a
  named GPU preset) with the measurements.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from medha_runtime.config import check_layout
from medha_runtime.executor import Executor, make_executor
from medha_runtime.plan import PlannedChunk, StepPlan
from medha_runtime.runner import RunnerSpec
from medha_runtime.sampling import SampleSpec
from medha_sched import AffineCostModel, ParallelDegrees, TableCostModel
from medha_sched.cost import (
    BatchWork,
    HardwareSpec,
    ModelShape,
    RooflineCostModel,
    get_hardware,
)

Item = tuple[int, int]  # (query tokens, KV tokens already cached)


def synthetic_plan(
    step_id: int, items: Sequence[Item], *, block_size: int, num_blocks: int, vocab_size: int
) -> StepPlan:
    """A step of one synthetic request per ``(q, kv)`` item, all on KVP group 0.

    Blocks are handed out in order and wrap around the pool (requests may
    share blocks: only the timing matters).
    """
    chunks = []
    next_block = 0
    for j, (q, kv) in enumerate(items):
        need = -(-(kv + q) // block_size)
        blocks = tuple((next_block + i) % num_blocks for i in range(need))
        next_block += need
        rid = f"__synthetic{j}"
        ids = tuple((7 * j + 13 * i + 1) % vocab_size for i in range(q))
        sample = SampleSpec(rid, 0.0, 0, 1.0, 0, None)
        chunks.append(PlannedChunk(rid, kv, ids, (0,), ((0, blocks),), sample))
    rids = tuple(c.request_id for c in chunks)
    return StepPlan(step_id, tuple(chunks), release_after=rids)


def time_steps(
    executor: Executor,
    batches: Sequence[Sequence[Item]],
    *,
    vocab_size: int,
    repeats: int = 3,
    warmup: int = 1,
) -> list[float]:
    """Trimmed mean seconds of each synthetic step, after ``warmup`` untimed
    rounds: ``repeats`` rounds over all the steps in turn, the fastest and
    slowest fifth of each step's runs dropped and the rest averaged.

    In turn rather than back to back: a small step repeated back to back keeps
    its KV in the CPU's caches, which a served step, among other requests'
    KV, does not (a 128-request decode at 4K context cost 3.2 ms a request,
    a lone decode 3.3 ms in all). A mean rather than the median, because a
    simulator adds step times up and on a busy or memory-bound CPU a step's
    time is skewed towards slow runs; trimmed, so that one stray run (a step
    timed right after a far larger one pays for the caches that one
    emptied) does not move the fit.
    """
    spec = executor.spec
    plans = [
        synthetic_plan(
            -1 - i, b, block_size=spec.block_size, num_blocks=spec.num_blocks, vocab_size=vocab_size
        )
        for i, b in enumerate(batches)
    ]
    for _ in range(warmup):
        for plan in plans:
            executor.execute(plan)
    times: list[list[float]] = [[] for _ in plans]
    for _ in range(repeats):
        for i, plan in enumerate(plans):
            t0 = time.perf_counter()
            executor.execute(plan)
            times[i].append(time.perf_counter() - t0)
    return [_trimmed_mean(t) for t in times]


def _trimmed_mean(values: list[float]) -> float:
    cut = len(values) // 5
    kept = sorted(values)[cut : len(values) - cut]
    return statistics.fmean(kept)


def _room(spec: RunnerSpec) -> int:
    """Most tokens one synthetic request may span: one KVP group's shard and pool."""
    return min(spec.group_tokens, spec.num_blocks * spec.block_size)


#: how much more the binding probe (the step the caller's budget comes from)
#: and the other probes weigh in the calibration fit than a generic step, in
#: squared relative error
PROBE_WEIGHT = 1e4
OTHER_PROBE_WEIGHT = 1.0


def calibrate_affine(
    executor: Executor,
    layout: ParallelDegrees,
    *,
    vocab_size: int,
    repeats: int = 3,
    max_tokens: int = 2048,
    probes: Mapping[Item, float] | None = None,
) -> AffineCostModel:
    """A quick affine cost model for this executor (a few synthetic steps).

    Fits ``seconds ~ base + per_token * tokens + per_attn * sum q*(kv+q)`` to
    single-request prefills and decode batches of at most ``max_tokens``
    tokens, plus one single-request step per ``probes`` item ``(q, kv)`` (cut
    to one KVP shard): the shapes a caller derives its budget from, each
    mapped to the factor it multiplies that step's predicted time by (the
    engine: twice a grid chunk at the end of the context, 1.1 times a
    ``throughput_chunk`` first chunk). The fit minimises squared *relative*
    errors; the binding probe (largest factor times measured seconds) weighs
    ``PROBE_WEIGHT`` times a generic step, the other probes
    ``OTHER_PROBE_WEIGHT`` times. One affine model cannot follow both CPU
    attention paths (chunks under 128 queries on the native kernel, large
    ones on torch's flash op, several times cheaper per pair), so it is made
    right where the budget is decided. Every constant is kept non-negative
    (``base`` strictly positive). A probe is timed once, or ``repeats`` times
    if it takes under ``PROBE_REPEAT_BELOW`` (see :func:`_time_probes`).
    """
    room = min(_room(executor.spec), max_tokens)
    batches: list[list[Item]] = [[(1, 0)]]
    for q in (32, 128, 512):
        if q <= room:
            batches.append([(q, 0)])
    q = 128 if room >= 256 else max(1, room // 4)
    for kv in (room // 2, room - q):
        if kv > 0 and kv + q <= room:
            batches.append([(q, kv)])
    kv = min(256, room - 1)
    batches.append([(1, kv)] * 16)
    secs = time_steps(executor, batches, vocab_size=vocab_size, repeats=repeats)
    weights = [1.0] * len(batches)
    factors = _probe_steps(probes or {}, _room(executor.spec))
    if factors:
        extra = [[item] for item in factors]
        probe_secs = _time_probes(executor, extra, vocab_size=vocab_size, repeats=repeats)
        budget = [f * s for f, s in zip(factors.values(), probe_secs, strict=True)]
        binding = budget.index(max(budget))
        weights += [PROBE_WEIGHT if i == binding else OTHER_PROBE_WEIGHT for i in range(len(extra))]
        batches += extra
        secs += probe_secs
    rows = []
    for b, s, w in zip(batches, secs, weights, strict=True):
        scale = w**0.5 / s  # weighted relative error
        tokens = float(sum(q for q, _ in b))
        pairs = float(sum(q * (kv + q) for q, kv in b))
        rows.append((scale, scale * tokens, scale * pairs))
    coef = _nonneg_lstsq(rows, [w**0.5 for w in weights])
    base = max(coef[0], 1e-6)
    return AffineCostModel(base=base, per_token=coef[1], per_attn=coef[2], layout=layout)


#: a probe step that ran faster than this (seconds) is timed ``repeats`` times
PROBE_REPEAT_BELOW = 0.5


def _time_probes(
    executor: Executor, steps: list[list[Item]], *, vocab_size: int, repeats: int
) -> list[float]:
    """Seconds of each probe step: one run without a warm-up (the generic steps'
    warm-up ran every code path), then ``repeats - 1`` more of the steps that
    took under ``PROBE_REPEAT_BELOW`` (a large first chunk can take seconds on
    a CPU, and the start-up waits for every run), averaged."""
    secs = time_steps(executor, steps, vocab_size=vocab_size, repeats=1, warmup=0)
    cheap = [i for i, s in enumerate(secs) if s < PROBE_REPEAT_BELOW]
    if cheap and repeats > 1:
        again = [steps[i] for i in cheap]
        more = time_steps(executor, again, vocab_size=vocab_size, repeats=repeats - 1, warmup=0)
        for i, s in zip(cheap, more, strict=True):
            secs[i] = (secs[i] + (repeats - 1) * s) / repeats
    return secs


def _probe_steps(probes: Mapping[Item, float], room: int) -> dict[Item, float]:
    """Each probe ``(q, kv)`` cut to fit ``room`` tokens (its KV shortened
    first, then its queries), with its factor (the largest, where two meet)."""
    out: dict[Item, float] = {}
    for (q, kv), factor in probes.items():
        if q < 1 or kv < 0 or not factor > 0:
            raise ValueError(
                f"a calibration probe needs q >= 1, kv >= 0 and a factor > 0, "
                f"got {(q, kv)}: {factor!r}"
            )
        q = min(q, room)
        item = (q, min(kv, room - q))
        out[item] = max(factor, out.get(item, 0.0))
    return out


def _nonneg_lstsq(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (drop negative ones and refit)."""
    n = len(rows[0])
    active = list(range(n))
    coef = [0.0] * n
    while active:
        a = torch.tensor([[r[j] for j in active] for r in rows], dtype=torch.float64)
        scale = a.abs().amax(dim=0).clamp_min(1e-30)
        y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a / scale, y).solution.squeeze(1) / scale
        values = sol.tolist()
        if all(v >= 0 for v in values):
            for j, v in zip(active, values, strict=True):
                coef[j] = v
            return coef
        worst = min(range(len(active)), key=lambda i: values[i])
        del active[worst]
    return coef


# ---------------------------------------------------------------------- profile
@dataclass(frozen=True)
class Grid:
    """What ``profile`` measures: every (q, kv) single-request prefill and
    every (n, kv) decode batch."""

    prefill_q: tuple[int, ...]
    prefill_kv: tuple[int, ...]
    decode_n: tuple[int, ...]
    decode_kv: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, least, count in (
            ("prefill_q", 1, 2),
            ("prefill_kv", 0, 2),
            ("decode_n", 2, 0),
            ("decode_kv", 0, 0),
        ):
            axis = getattr(self, name)
            if len(axis) < count:
                raise ValueError(f"grid {name} needs at least {count} values, got {list(axis)}")
            if any(not isinstance(v, int) or isinstance(v, bool) for v in axis):
                raise ValueError(f"grid {name} must hold integers, got {list(axis)}")
            if axis and (axis[0] < least or any(b <= a for a, b in pairwise(axis))):
                raise ValueError(
                    f"grid {name} must be strictly increasing integers >= {least}, got {list(axis)}"
                )
        if bool(self.decode_n) != bool(self.decode_kv):
            raise ValueError(
                f"grid decode_n={list(self.decode_n)} and decode_kv={list(self.decode_kv)} "
                "must both be given or both be empty"
            )

    @property
    def max_tokens(self) -> int:
        return max(max(self.prefill_q) + max(self.prefill_kv), max(self.decode_kv, default=0) + 1)


QUICK_GRID = Grid((1, 16, 64, 256), (0, 512, 2048), (2, 8, 32), (256,))
FULL_GRID = Grid(
    (1, 16, 32, 64, 128, 256, 512, 1024, 2048),
    (0, 1024, 4096, 16384),
    (2, 4, 8, 16, 32, 64, 128),
    (512, 4096),
)


@dataclass
class ProfileResult:
    """A fitted table and how well the roofline model predicted the measurements."""

    table: TableCostModel
    samples: list[tuple[BatchWork, float]]
    roofline: RooflineCostModel
    roofline_errors: list[float]
    table_errors: list[float]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = self.table.to_dict()
        data["meta"] = self.meta
        return data

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    def summary(self) -> str:
        hw = self.roofline.hardware
        r, t = self.roofline_errors, self.table_errors
        return "\n".join(
            [
                f"roofline ({hw.name}: {hw.flops_rate / 1e9:.1f} GFLOP/s, "
                f"{hw.memory_rate / 1e9:.1f} GB/s, {hw.kernel_overhead * 1e6:.1f} us per kernel): "
                f"mean relative error {100 * statistics.fmean(r):.1f}%, "
                f"max {100 * max(r):.1f}% over {len(r)} measurements",
                f"fitted table: mean relative error {100 * statistics.fmean(t):.1f}%, "
                f"max {100 * max(t):.1f}%",
            ]
        )


def measure_hardware(device: str, dtype: torch.dtype, *, name: str | None = None) -> HardwareSpec:
    """This device's achievable matmul FLOP/s, copy bandwidth and per-op overhead (quick)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def best(fn: Callable[[], Any], reps: int) -> float:
        fn()
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    n = 4096 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    flops = 2 * n**3 / best(lambda: a @ b, 5)
    numel = (256 << 20) // 4 if dev.type == "cuda" else (32 << 20) // 4
    src = torch.empty(numel, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / best(lambda: dst.copy_(src), 5)
    x = torch.zeros(1, device=dev)

    def small_ops() -> None:
        for _ in range(100):
            x.add_(1)

    overhead = best(small_ops, 5) / 100
    return HardwareSpec(
        name=name or f"measured-{dev.type}",
        peak_flops=flops,
        hbm_bandwidth=bandwidth,
        interconnect_bandwidth=bandwidth,
        kernel_overhead=overhead,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
    )


def model_shape(config: Any, *, name: str, bytes_per_param: float) -> ModelShape:
    """The roofline model's view of a :class:`~medha_runtime.model.ModelConfig`."""
    return ModelShape(
        name=name,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        bytes_per_param=bytes_per_param,
    )


def _rel(pred: float, actual: float) -> float:
    return abs(pred - actual) / actual


def run_profile(
    model: str = "tiny",
    *,
    dtype: str = "auto",
    device: str | None = None,
    tp: int = 1,
    spp: int = 1,
    kvp: int = 1,
    block_size: int = 16,
    grid: Grid = QUICK_GRID,
    repeats: int = 3,
    hardware: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> ProfileResult:
    """Measure ``grid`` on this device and fit a table (see the module docstring)."""
    from medha_runtime.engine import load_model_info
    from medha_runtime.model.config import dtype_name, resolve_dtype

    config, _ = load_model_info(model)
    torch_dtype = resolve_dtype(dtype if dtype == "auto" else dtype_name(dtype), config)
    # refuse what cannot run before any worker starts (a bad layout would fail in them)
    device = check_layout(config, tp=tp, spp=spp, device=device, local_ranks=tp * spp * kvp)
    preset = get_hardware(hardware) if hardware else None  # a bad name before the measuring
    room = -(-grid.max_tokens // block_size) * block_size
    decode_blocks = max(
        (n * -(-(kv + 1) // block_size) for n in grid.decode_n for kv in grid.decode_kv),
        default=0,
    )
    num_blocks = max(room // block_size, decode_blocks)
    spec = RunnerSpec(
        model=model,
        dtype=dtype_name(torch_dtype),
        device=device,
        tp=tp,
        spp=spp,
        kvp=kvp,
        num_blocks=num_blocks,
        block_size=block_size,
        group_tokens=room,
    )
    layout = ParallelDegrees(tp=tp, spp=spp, kvp=kvp)
    log(
        f"profiling {model} ({spec.dtype}, {device}, tp={tp} spp={spp} kvp={kvp}): "
        f"{len(grid.prefill_q) * len(grid.prefill_kv)} prefill and "
        f"{len(grid.decode_n) * len(grid.decode_kv)} decode points"
    )
    t0 = time.perf_counter()
    batches: list[list[Item]] = [[(q, kv)] for q in grid.prefill_q for kv in grid.prefill_kv]
    batches += [[(1, kv)] * n for n in grid.decode_n for kv in grid.decode_kv]
    executor = make_executor(spec)
    try:
        secs = time_steps(executor, batches, vocab_size=config.vocab_size, repeats=repeats)
    finally:
        executor.shutdown()
    elapsed = time.perf_counter() - t0
    samples = [(BatchWork.single_group(*b), s) for b, s in zip(batches, secs, strict=True)]
    table = TableCostModel.fit(samples, layout=layout)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shape = model_shape(config, name=model, bytes_per_param=itemsize)
    hw = preset if preset is not None else measure_hardware(device, torch_dtype)
    roofline = RooflineCostModel(model=shape, hardware=hw, layout=layout)
    r_err = [_rel(roofline.predict(b), s) for b, s in samples]
    t_err = [_rel(table.predict(b), s) for b, s in samples]
    meta = {
        "model": model,
        "dtype": spec.dtype,
        "device": device,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "block_size": block_size,
        "repeats": repeats,
        "measure_seconds": round(elapsed, 3),
        "measurements": [
            {"q_tokens": b[0][0], "kv_tokens": b[0][1], "requests": len(b), "seconds": s}
            for b, s in zip(batches, secs, strict=True)
        ],
        "roofline": {
            "hardware": {
                "name": hw.name,
                "flops_per_s": hw.flops_rate,
                "bytes_per_s": hw.memory_rate,
                "kernel_overhead_s": hw.kernel_overhead,
            },
            "mean_relative_error": statistics.fmean(r_err),
            "max_relative_error": max(r_err),
        },
        "table_fit": {
            "mean_relative_error": statistics.fmean(t_err),
            "max_relative_error": max(t_err),
        },
    }
    log(f"measured {len(samples)} steps in {elapsed:.1f}s")
    return ProfileResult(table, samples, roofline, r_err, t_err, meta)


def relative_errors(model: Any, samples: Sequence[tuple[BatchWork, float]]) -> list[float]:
    """``|predicted - measured| / measured`` of ``model`` on each sample."""
    return [_rel(model.predict(b), s) for b, s in samples]


__all__ = [
    "FULL_GRID",
    "QUICK_GRID",
    "Grid",
    "ProfileResult",
    "calibrate_affine",
    "measure_hardware",
    "model_shape",
    "relative_errors",
    "run_profile",
    "synthetic_plan",
    "time_steps",
]
