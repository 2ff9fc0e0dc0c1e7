"""A per-step timing log: what each batch held, what it was predicted to cost, what it took.

``LLMEngine(step_log=PATH)`` (``medha-runtime serve --step-log PATH``) writes
one JSON object per line for every batch it runs::

    {"step": 7, "start_s": 12.345678,        # engine clock when schedule() began
     "schedule_s": 0.0004,                   # forming the batch
     "execute_s": 0.0521,                    # the executor (forward pass and sampling)
     "finish_s": 0.0002,                     # results back into the scheduler
     "predicted_s": 0.0498,                  # the cost model's latency for the batch
     "error": 0.044,                         # |predicted_s - measured| / measured
     "target_s": 0.05,                       # the budget T the batch was packed against
     "monotonic_s": 81234.567,               # time.monotonic() when schedule() began
     "items": [[1, 300], [512, 1024]],       # [query tokens, KV tokens cached before]
     "requests": ["a", "b"]}                 # the items' request ids

With stream pipelining (SPP > 1) a record also holds ``"stage_s"``: each
stage's own seconds for the batch (its slowest rank, less its wait for the
previous stage). The batch's latency through the model is then their sum,
which is what the cost model predicts and learns (``execute_s`` also holds
the wait behind the previous batch on a later stage), so ``error`` is
measured against that sum; without ``stage_s`` it is measured against
``execute_s``.

When the engine's cost model is an online one, the engine also saves that
model's state as it was before the first step (its start-up calibration, or
the file it was loaded from) beside the log, as :func:`initial_model_path`
names it, so that ``benchmarks/replay_cost.py`` can replay the log from where
the server started.

The gap between two consecutive ``start_s`` is the whole iteration as a
client sees it: the three phases above plus whatever the caller does between
steps (the server's detokenising and streaming). :func:`read_step_log` reads
the file back; :func:`step_overheads` measures that per-step overhead, and
:func:`check_predictions` prices the logged steps with a cost model (a
profile, say) to compare with what they took.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import IO

from medha_sched.cost import BatchWork, CostModel
from medha_sched.output import ScheduleOutput


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One batch's timings (seconds) and work; see the module docstring."""

    step: int
    start_s: float
    schedule_s: float
    execute_s: float
    finish_s: float
    predicted_s: float
    items: tuple[tuple[int, int], ...]
    requests: tuple[str, ...] = ()
    target_s: float = 0.0
    monotonic_s: float = 0.0
    stage_s: tuple[float, ...] = ()

    @property
    def measured_s(self) -> float:
        """The batch's latency through the model: the sum of ``stage_s`` with SPP > 1,
        else ``execute_s``."""
        return sum(self.stage_s) if self.stage_s else self.execute_s

    @property
    def error(self) -> float:
        """Relative prediction error ``|predicted_s - measured_s| / measured_s``."""
        measured = self.measured_s
        return abs(self.predicted_s - measured) / measured if measured else 0.0

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.items)

    @classmethod
    def from_dict(cls, d: dict) -> StepRecord:
        """The inverse of :meth:`to_dict`; raises ``KeyError``/``TypeError``/``ValueError``."""
        return cls(
            step=int(d["step"]),
            start_s=float(d["start_s"]),
            schedule_s=float(d["schedule_s"]),
            execute_s=float(d["execute_s"]),
            finish_s=float(d["finish_s"]),
            predicted_s=float(d["predicted_s"]),
            items=tuple((int(q), int(kv)) for q, kv in d["items"]),
            requests=tuple(str(r) for r in d.get("requests", ())),
            target_s=float(d.get("target_s", 0.0)),
            monotonic_s=float(d.get("monotonic_s", 0.0)),
            stage_s=tuple(float(t) for t in d.get("stage_s", ())),
        )

    def to_dict(self) -> dict:
        d = {
            "step": self.step,
            "start_s": round(self.start_s, 6),
            "schedule_s": round(self.schedule_s, 6),
            "execute_s": round(self.execute_s, 6),
            "finish_s": round(self.finish_s, 6),
            "predicted_s": round(self.predicted_s, 6),
            "items": [list(i) for i in self.items],
            "requests": list(self.requests),
            "error": round(self.error, 6),
            "target_s": round(self.target_s, 6),
            "monotonic_s": round(self.monotonic_s, 6),
        }
        if self.stage_s:
            d["stage_s"] = [round(t, 6) for t in self.stage_s]
        return d


def initial_model_path(log_path: str | os.PathLike[str]) -> str:
    """Where the engine saves the online cost model it starts a step log with:
    ``<log_path>.initial.json``."""
    return f"{os.fspath(log_path)}.initial.json"


class StepLog:
    """Appends :class:`StepRecord` s to a JSON-lines file (line-buffered)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self._file: IO[str] | None = open(  # noqa: SIM115 (closed by close())
                self.path, "w", encoding="utf-8", buffering=1
            )
        except OSError as exc:
            raise ValueError(f"cannot write the step log {self.path!r}: {exc.strerror}") from None

    def record(
        self,
        out: ScheduleOutput,
        marks: Sequence[float],
        start_s: float,
        stage_s: Sequence[float] = (),
    ) -> None:
        """Log batch ``out``; ``marks`` are four ``perf_counter`` readings: before
        scheduling, after it, after the executor and after the results went back.
        ``stage_s``: each stage's own seconds with SPP > 1 (empty otherwise)."""
        if self._file is None:
            return
        t0, t1, t2, t3 = marks
        rec = StepRecord(
            step=out.batch_id,
            start_s=start_s,
            schedule_s=t1 - t0,
            execute_s=t2 - t1,
            finish_s=t3 - t2,
            predicted_s=out.predicted_time,
            items=tuple((c.num_tokens, c.start) for c in out.chunks),
            requests=tuple(c.request_id for c in out.chunks),
            target_s=out.target_time,
            monotonic_s=time.monotonic() - (time.perf_counter() - t0),
            stage_s=tuple(stage_s),
        )
        self._file.write(json.dumps(rec.to_dict(), separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_step_log(path: str | os.PathLike[str]) -> list[StepRecord]:
    """The records of a step log, in order; a bad line is a ``ValueError`` naming it."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(StepRecord.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{os.fspath(path)}:{n}: not a step record ({exc})") from None
    return records


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOverhead:
    """Per-step time outside the executor, over back-to-back steps (seconds).

    Attributes:
        steps: back-to-back steps measured.
        median_s: median of (gap to the next step's start - ``execute_s``).
        mean_s: the mean of the same.
        execute_share: total ``execute_s`` over total gap time.
    """

    steps: int
    median_s: float
    mean_s: float
    execute_share: float


def step_overheads(records: Sequence[StepRecord], *, max_idle_s: float = 0.05) -> StepOverhead:
    """Overhead of each step whose successor started within ``max_idle_s`` of it
    ending (back-to-back steps: the engine had work in between, not idle time)."""
    over, gaps, execs = [], 0.0, 0.0
    for a, b in pairwise(records):
        gap = b.start_s - a.start_s
        busy = a.schedule_s + a.execute_s + a.finish_s
        if gap - busy > max_idle_s:
            continue
        over.append(gap - a.execute_s)
        gaps += gap
        execs += a.execute_s
    if not over:
        raise ValueError("the step log has no back-to-back steps")
    return StepOverhead(
        steps=len(over),
        median_s=statistics.median(over),
        mean_s=statistics.fmean(over),
        execute_share=execs / gaps,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictionCheck:
    """A cost model's predictions against the measured times of logged steps
    (:attr:`StepRecord.measured_s`: ``execute_s``, or the stage sum with SPP > 1).

    Attributes:
        steps: steps compared.
        measured_s: total measured seconds.
        predicted_s: total predicted seconds.
        median_ratio: median over steps of measured over predicted seconds.
    """

    steps: int
    measured_s: float
    predicted_s: float
    median_ratio: float


def check_predictions(model: CostModel, records: Sequence[StepRecord]) -> PredictionCheck:
    """Price every logged step with ``model`` (one KVP group, every item a tail
    item, as this log records single-group layouts) and compare."""
    if not records:
        raise ValueError("the step log is empty")
    predicted = [model.predict(BatchWork.single_group(*r.items)) for r in records]
    ratios = [r.measured_s / p for r, p in zip(records, predicted, strict=True) if p > 0]
    return PredictionCheck(
        steps=len(records),
        measured_s=sum(r.measured_s for r in records),
        predicted_s=sum(predicted),
        median_ratio=statistics.median(ratios) if ratios else float("nan"),
    )


__all__ = [
    "PredictionCheck",
    "StepLog",
    "StepOverhead",
    "StepRecord",
    "check_predictions",
    "read_step_log",
    "step_overheads",
]
