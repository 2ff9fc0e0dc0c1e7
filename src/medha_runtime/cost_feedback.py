"""Every executed step teaches the cost model, and its prediction error is kept.

:class:`CostFeedback` sits beside the engine's step loop. After the executor
returns, :meth:`CostFeedback.record` gets the batch the scheduler formed and
the executor's measured seconds. It

* computes the relative prediction error ``|predicted - measured| / measured``
  of the scheduler's own prediction (``ScheduleOutput.predicted_time``), for
  any cost model;
* feeds an :class:`~medha_sched.cost.online.OnlineCostModel` the batch as a
  :class:`~medha_sched.cost.BatchWork` (one item per chunk and KVP shard, as
  the scheduler priced it) and the measured time, so the next batches are
  packed with the corrected coefficients.

Errors are kept in two bounded buffers: the last 100 (for a median) and the
ones not yet taken by :meth:`drain` (the server's metrics).

What is measured. A cost model prices one batch's latency through all the
layers: with stream pipelining (SPP > 1) the sum of the stage times (see
:mod:`medha_sched.cost.roofline`; the paper's iteration time is the batch's
time through the whole model, the stages overlapping *different* batches).
With SPP > 1 the executor's wall time from submit to done is not that
quantity: a batch waits behind the previous one on the later stages. So with
SPP > 1 the measured time is the sum over stages of each stage's own seconds
(the slowest rank of the stage, less its wait for the previous stage's
activations), which the multi-process executor reports per batch
(``StepDone.stage_s``); both the error and the learning use it. An executor
that reports no stage times (the torch.distributed one with SPP > 1) leaves
SPP > 1 unlearned, its errors measured against the wall time as before. With
SPP = 1 (any TP and KVP) the wall time is the batch's latency and is used as
is, except with async scheduling, where a batch waits behind the previous one
and the engine passes the batch's own execution seconds instead.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque

from medha_sched.batch_cost import chunk_works
from medha_sched.cost import BatchWork, CostModel, RequestWork
from medha_sched.cost.online import OnlineCostModel
from medha_sched.output import ScheduleOutput

_WINDOW = 100
_PENDING = 4096


class CostFeedback:
    """Prediction errors of executed steps; online learning when the model can.

    Args:
        model: the scheduler's cost model (the very object it prices with).
        group_limit: KV tokens per KVP shard (to split chunks as the scheduler did).
        save_to: where :meth:`save` writes an online model's state (None: nowhere).
    """

    def __init__(
        self, model: CostModel, *, group_limit: int, save_to: str | os.PathLike[str] | None = None
    ) -> None:
        self.model = model
        online = isinstance(model, OnlineCostModel)
        self._online = online
        self._spp = model.layout.spp
        #: True once the model learns: at once with SPP = 1, and with SPP > 1
        #: from the first batch whose per-stage times the executor reports
        self.learning = online and self._spp == 1
        self._group_limit = group_limit
        self._kvp = model.layout.kvp
        self.save_to = None if save_to is None else os.fspath(save_to)
        if self.save_to is not None and not online:
            raise ValueError(
                f"cost_model_out={self.save_to!r} saves an online cost model, but the engine "
                f"runs {type(model).__name__}; use cost_model='online' (the default)"
            )
        if self.save_to is not None:  # refused now, not after the work at shutdown
            _check_writable(self.save_to)
        self.recent: deque[float] = deque(maxlen=_WINDOW)
        self._pending: deque[float] = deque(maxlen=_PENDING)
        self.steps = 0
        self.rescues = 0
        #: wall seconds per executor second of back-to-back steps (EWMA, >= 1)
        self.overhead = 1.0
        self._last: float | None = None  # perf_counter when the last step's executor ended
        #: batch id -> the work priced at issue (:meth:`issued`), taken by :meth:`record`
        self._issued: dict[int, BatchWork] = {}

    def measured(self, seconds: float, stage_s: tuple[float, ...] = ()) -> float | None:
        """The batch's latency to compare with its prediction (None: not measured).

        ``seconds`` is the executor's wall time, ``stage_s`` each pipeline
        stage's own seconds (empty when the executor does not report them).
        """
        if self._spp == 1:
            return seconds if seconds > 0 else None
        if len(stage_s) != self._spp or not all(t > 0 for t in stage_s):
            return None
        return sum(stage_s)

    def record(
        self, out: ScheduleOutput, seconds: float, stage_s: tuple[float, ...] = ()
    ) -> float | None:
        """Account one executed batch; returns its relative prediction error.

        Args:
            out: the batch as the scheduler formed it.
            seconds: the executor's wall seconds from submit to done.
            stage_s: each pipeline stage's own seconds (see the module docstring).
        """
        work = self._issued.pop(out.batch_id, None)
        if not seconds > 0:
            return None
        latency = self.measured(seconds, stage_s)
        if latency is not None and self._online and not self.learning:
            self.learning = True  # SPP > 1: the executor reports stage times
        truth = seconds if latency is None else latency
        error = abs(out.predicted_time - truth) / truth
        self.recent.append(error)
        self._pending.append(error)
        self.steps += 1
        now = time.perf_counter()
        if self._last is not None:
            # from the previous step's executor end to this one's: this step's
            # executor time plus everything the engine did in between
            gap = now - self._last
            if gap < 2.0 * seconds + 0.05:  # back to back: the engine had work in between
                ratio = max(1.0, gap / seconds)
                self.overhead = 0.9 * self.overhead + 0.1 * min(ratio, 10.0)
        self._last = now
        if self.learning and latency is not None:
            model = self.model
            cap = 0.5 * out.target_time  # a lone one-token step must fit T (liveness)
            if out.target_time > 0 and model.fixed_cost_cap != cap:  # type: ignore[attr-defined]
                model.cap_fixed_cost(cap)  # type: ignore[attr-defined]
            if work is None:
                work = self.batch_work(out)
            model.observe(work, latency)  # type: ignore[attr-defined]
        return error

    def rescue(self) -> bool:
        """The scheduler formed no batch while requests wait: if the model is
        learning, halve its coefficients (a device slower than the budget T
        allows can price every grid chunk above T; the scheduler only checks
        feasibility at admission) and return True. The next steps relearn."""
        if not self.learning:
            return False
        self.rescues += 1
        self.model.rescale(0.5)  # type: ignore[attr-defined]
        return True

    def issued(self, out: ScheduleOutput) -> BatchWork:
        """:meth:`batch_work` of a batch just shipped, kept for its :meth:`record`
        (the work is computed once per step). Only batches shipped and not yet
        recorded are kept (at most the batches in flight)."""
        work = self._issued[out.batch_id] = self.batch_work(out)
        return work

    def batch_work(self, out: ScheduleOutput) -> BatchWork:
        """``out`` as the scheduler priced it: each chunk split over its KVP shards."""
        groups: list[list[RequestWork]] = [[] for _ in range(self._kvp)]
        limit = self._group_limit
        for c in out.chunks:
            for g, q, kv, tail in chunk_works(c.kvp_groups, c.start, c.num_tokens, limit):
                groups[g].append(RequestWork(q, kv, tail))
        return BatchWork(groups=tuple(tuple(items) for items in groups))

    @property
    def median_error(self) -> float | None:
        """Median relative error of the last (up to) 100 steps."""
        return statistics.median(self.recent) if self.recent else None

    def drain(self) -> list[float]:
        """Errors recorded since the previous call (at most the latest 4096)."""
        errors = list(self._pending)
        self._pending.clear()
        return errors

    def save(self) -> None:
        """Write the online model's state to ``save_to`` (if set)."""
        if self.save_to is not None:
            self.model.save(self.save_to)  # type: ignore[attr-defined]


def _check_writable(path: str) -> None:
    """Raise ValueError (naming ``path``) where a file cannot be written there."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        why = "it is a directory"
    elif not os.path.isdir(folder):
        why = f"no directory {folder}"
    elif not os.access(folder, os.W_OK):
        why = f"{folder} is not writable"
    else:
        return
    raise ValueError(f"cannot write cost_model_out={path!r}: {why}")
