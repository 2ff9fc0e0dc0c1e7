"""What a simulation measures, and the files it writes.

Per request (:class:`RequestRecord`), times in seconds on the trace clock:

* ``ttft_s`` = first token time - arrival. The first token is sampled by the
  batch that completes the prompt's prefill; it exists when that batch
  leaves the last pipeline stage.
* ``tpot_s`` = (finish - first token) / (output tokens - 1); ``None`` for a
  one-token output.
* ``e2e_s`` = finish - arrival.
* ``deadline_s``: the absolute TTFT deadline the scheduler fixed when it saw
  the request (``arrival + admission delay + D``, as a server's scheduler fixes
  it on admission); ``met_deadline`` is ``first token time <= deadline_s``,
  that is ``ttft_s <= D`` plus the admission delay (0 by default).
* ``preemptions``: times the request was preempted by recompute.

A request the configuration can never serve (``RequestTooLongError``) is
*rejected*: it keeps its line in ``requests.jsonl`` with ``rejected`` set
and null times, is counted in the summary, and counts as missing its
deadline in ``goodput``.

Per iteration (:class:`IterationRecord`): the batch id, issue time,
predicted latency, decode count, prefill chunk count and prefill tokens,
and how many requests were preempted forming it. The summary gives their
averages under ``batches``; ``iterations.csv`` (opt-in: a busy day is
millions of rows) lists them all.

**Short and long.** A request is *long* when its prompt has at least the
scheduler's ``long_prefill_threshold`` tokens (32,768 by default), the same
rule the packer uses for "at most one long prefill per KVP group".
"""

from __future__ import annotations

import csv
import json
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from struct import Struct
from struct import error as struct_error
from typing import NamedTuple, overload

import numpy as np

from medha_sched.sim.trace import TraceRequest

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """One request's fate in a simulation."""

    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    deadline_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    rejected: str | None = None  # the reason, when the request was rejected

    @classmethod
    def from_trace(cls, r: TraceRequest) -> RequestRecord:
        return cls(r.id, r.arrival_s, r.prompt_tokens, r.output_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def met_deadline(self) -> bool:
        if self.first_token_s is None or self.deadline_s is None:
            return False
        return self.first_token_s <= self.deadline_s

    def to_json(self, long_threshold: int) -> dict[str, object]:
        return {
            "id": self.id,
            "arrival_s": self.arrival_s,
            "first_token_s": self.first_token_s,
            "finish_s": self.finish_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "deadline_s": self.deadline_s,
            "met_deadline": self.met_deadline,
            "preemptions": self.preemptions,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "long": self.prompt_tokens >= long_threshold,
            "rejected": self.rejected is not None,
            "reject_reason": self.rejected,
        }


class IterationRecord(NamedTuple):
    """One issued batch."""

    batch_id: int
    start_s: float
    predicted_s: float
    decodes: int
    prefill_chunks: int
    prefill_tokens: int
    preempted: int

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill_tokens


_COLUMNS = IterationRecord._fields
_TYPECODES = ("q", "d", "d", "q", "q", "q", "q")  # int64 / float64, field by field


class IterationLog(Sequence[IterationRecord]):
    """The issued batches of a run, in issue order: a sequence of
    :class:`IterationRecord`, kept as one array per field.

    A long run has millions of batches; a tuple per batch costs an object (and
    its time to make, collect and free) that the columns do not. Reading an
    item builds its record; :meth:`columns` gives the arrays themselves
    (``batch_id``, ``decodes``, ``prefill_chunks``, ``prefill_tokens``,
    ``preempted`` int64; ``start_s``, ``predicted_s`` float64; all of length
    ``len(self)``). A value is stored as its field's type: an ``int`` time
    reads back as a ``float``.

    Args:
        records: records to start with (any iterable of 7-field rows).
    """

    __slots__ = _COLUMNS
    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __init__(self, records: Iterable[Sequence[float]] = ()) -> None:
        for name, code in zip(_COLUMNS, _TYPECODES, strict=True):
            setattr(self, name, array(code))
        for r in records:
            self.append(*r)

    def append(
        self,
        batch_id: int,
        start_s: float,
        predicted_s: float,
        decodes: int,
        prefill_chunks: int,
        prefill_tokens: int,
        preempted: int,
    ) -> None:
        """Add one batch (the fields of :class:`IterationRecord`, in order); a value
        a column refuses (a float where an int goes) raises and leaves the log as it was."""
        try:
            self.batch_id.append(batch_id)
            self.start_s.append(start_s)
            self.predicted_s.append(predicted_s)
            self.decodes.append(decodes)
            self.prefill_chunks.append(prefill_chunks)
            self.prefill_tokens.append(prefill_tokens)
            self.preempted.append(preempted)
        except BaseException:
            before = len(self.preempted)  # the last column: not appended to
            for col in self.columns():
                del col[before:]
            raise

    def extend(
        self,
        batch_ids: Iterable[int],
        starts: Iterable[float],
        predicted: Iterable[float],
        decodes: Iterable[int],
        prefill_chunks: Iterable[int],
        prefill_tokens: Iterable[int],
        preempted: Iterable[int],
    ) -> None:
        """Add batches column by column: the ``i``-th item of each argument is
        the ``i``-th batch's field. Every argument must have the same length
        (checked: a mismatch raises ValueError and leaves the log as it was)."""
        cols = self.columns()
        before = len(self.batch_id)
        try:
            for col, values in zip(
                cols,
                (batch_ids, starts, predicted, decodes, prefill_chunks, prefill_tokens, preempted),
                strict=True,
            ):
                kind = type(values)
                if kind is list:
                    _from_list(col, values)
                elif kind is range and col.typecode == "q" and _exact_arange(values):
                    ids = np.arange(values.start, values.stop, dtype=np.int64)
                    col.frombytes(ids.tobytes())  # a copy of memory, not an int per id
                else:
                    col.extend(values)
        except BaseException:  # a value a column refuses: nothing of the call is kept
            for col in cols:
                del col[before:]
            raise
        if len(set(map(len, cols))) != 1:
            for col in cols:
                del col[before:]
            raise ValueError("IterationLog.extend: the columns have different lengths")

    def columns(self) -> tuple[array, ...]:
        """The seven arrays, in :class:`IterationRecord`'s field order (not copies)."""
        return (
            self.batch_id,
            self.start_s,
            self.predicted_s,
            self.decodes,
            self.prefill_chunks,
            self.prefill_tokens,
            self.preempted,
        )

    def __len__(self) -> int:
        return len(self.batch_id)

    @overload
    def __getitem__(self, index: int) -> IterationRecord: ...
    @overload
    def __getitem__(self, index: slice) -> list[IterationRecord]: ...
    def __getitem__(self, index: int | slice) -> IterationRecord | list[IterationRecord]:
        if isinstance(index, slice):
            rows = zip(*(c[index] for c in self.columns()), strict=True)
            return list(map(IterationRecord._make, rows))
        return IterationRecord._make(c[index] for c in self.columns())

    def __iter__(self) -> Iterator[IterationRecord]:
        return map(IterationRecord._make, zip(*self.columns(), strict=True))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IterationLog):
            return self.columns() == other.columns()
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"IterationLog({len(self)} batches)"


class IterationRows:
    """Batches bound for an :class:`IterationLog`, gathered in one list per field
    and moved into it in blocks (:meth:`IterationLog.extend` of lists: one
    conversion per column a block, not one per call): the same records, in
    the same order, once :meth:`flush` has run. A simulation's turn runs
    record some 13 batches a call, and a call of ``IterationLog.extend`` has
    a fixed cost of its own (about 11 K instructions in CPython 3.11, some
    dozens of values' conversions); the values' conversion stays.

    Call :meth:`flush` before the log is read or written otherwise. A value
    a column refuses raises at the flush that moves it (the log keeps what
    it had, this buffer its rows), or at :meth:`append` when it goes
    straight into the log.

    Args:
        log: where the rows go.
        block: the rows gathered before they move on their own.
    """

    __slots__ = ("_block", "_cols", "_log")

    def __init__(self, log: IterationLog, block: int = 8192) -> None:
        self._log = log
        self._block = block
        self._cols: tuple[list, ...] = tuple([] for _ in _COLUMNS)

    def __len__(self) -> int:
        """Rows gathered and not moved yet."""
        return len(self._cols[0])

    def append(
        self,
        batch_id: int,
        start_s: float,
        predicted_s: float,
        decodes: int,
        prefill_chunks: int,
        prefill_tokens: int,
        preempted: int,
    ) -> None:
        """:meth:`IterationLog.append`, gathered; straight into the log when
        nothing is gathered (the same order: a batch issued alone between
        decode runs costs no block of its own)."""
        b, s, p, d, c, t, x = self._cols
        if not b:
            self._log.append(
                batch_id, start_s, predicted_s, decodes, prefill_chunks, prefill_tokens, preempted
            )
            return
        b.append(batch_id)
        s.append(start_s)
        p.append(predicted_s)
        d.append(decodes)
        c.append(prefill_chunks)
        t.append(prefill_tokens)
        x.append(preempted)
        if len(b) >= self._block:
            self.flush()

    def extend(
        self,
        batch_ids: Sequence[int],
        starts: Sequence[float],
        predicted: Sequence[float],
        decodes: Sequence[int],
        prefill_chunks: Sequence[int],
        prefill_tokens: Sequence[int],
        preempted: Sequence[int],
    ) -> None:
        """:meth:`IterationLog.extend`, gathered (arguments of the same length,
        checked: a mismatch raises ValueError and gathers nothing)."""
        values = (batch_ids, starts, predicted, decodes, prefill_chunks, prefill_tokens, preempted)
        if len(set(map(len, values))) != 1:
            raise ValueError("IterationRows.extend: the columns have different lengths")
        for col, v in zip(self._cols, values, strict=True):
            col.extend(v)
        if len(self._cols[0]) >= self._block:
            self.flush()

    def flush(self) -> None:
        """Move every gathered row into the log."""
        cols = self._cols
        if cols[0]:
            self._log.extend(*cols)
            for col in cols:
                col.clear()


_EXACT = 1 << 52


def _exact_arange(ids: range) -> bool:
    """True when ``numpy.arange(ids.start, ids.stop)`` holds the ints of ``ids`` (a
    step of 1, bounds whose difference a double holds exactly: numpy sizes the
    result in floating point), so they go into an int64 column as one copy."""
    return ids.step == 1 and ids.start > -_EXACT and ids.stop < _EXACT


_PACKERS: dict[tuple[str, int], Callable[..., bytes]] = {}
"""``struct.Struct(f"{n}{code}").pack`` by typecode and length (at most ``_MAX_PACKERS``)."""
_MAX_PACKERS = 4096


def _from_list(col: array, values: list[float]) -> None:
    """``col.fromlist(values)``, packed by ``struct`` (one C conversion per item, about
    half the instructions of ``fromlist``'s parsing of each one): the same bytes;
    a value ``struct`` refuses goes to ``fromlist``, which raises as it did."""
    key = (col.typecode, len(values))
    pack = _PACKERS.get(key)
    if pack is None:
        if len(_PACKERS) >= _MAX_PACKERS:
            _PACKERS.clear()
        pack = _PACKERS[key] = Struct(f"{key[1]}{key[0]}").pack
    try:
        data = pack(*values)
    except struct_error:
        col.fromlist(values)  # raises (or stores what struct would not)
        return
    col.frombytes(data)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """``{"n", "mean", "p50", "p90", "p99"}`` of ``values``."""
    out: dict[str, float | int | None] = {"n": len(values)}
    out["mean"] = sum(values) / len(values) if values else None
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(
    records: Sequence[RequestRecord],
    iterations: Sequence[IterationRecord],
    *,
    long_threshold: int,
    num_stages: int = 1,
) -> dict[str, object]:
    """The ``summary.json`` content (without run configuration and wall time)."""
    groups = {
        "all": list(records),
        "short": [r for r in records if r.prompt_tokens < long_threshold],
        "long": [r for r in records if r.prompt_tokens >= long_threshold],
    }
    done = [r for r in records if r.finished]
    out: dict[str, object] = {
        "long_rule": f"prompt_tokens >= {long_threshold} (the scheduler's long_prefill_threshold)",
        "counts": {
            "requests": len(records),
            "finished": len(done),
            "rejected": sum(r.rejected is not None for r in records),
            "short": len(groups["short"]),
            "long": len(groups["long"]),
            "preemptions": sum(r.preemptions for r in records),
            "iterations": len(iterations),
        },
    }
    for metric in ("ttft_s", "tpot_s", "e2e_s"):
        out[metric] = {
            name: distribution([v for r in rs if (v := getattr(r, metric)) is not None])
            for name, rs in groups.items()
        }
    out["deadline_met"] = {
        name: (sum(r.met_deadline for r in rs) / len(rs) if rs else None)
        for name, rs in groups.items()
    }
    # goodput: fraction of all requests (rejected ones included) meeting the deadline
    out["goodput"] = out["deadline_met"]["all"]  # type: ignore[index]
    out["throughput"] = _throughput(records, done, iterations, num_stages)
    out["batches"] = _batches(iterations)
    return out


def _batches(iterations: Sequence[IterationRecord]) -> dict[str, object]:
    """What the batches held, on average, and how long they were predicted to take.

    numpy, because a long run has millions of batches.
    """
    n = len(iterations)
    if not n:
        return {"n": 0}

    def column(i: int, dtype: type) -> np.ndarray:
        if isinstance(iterations, IterationLog):  # the arrays as they are
            return np.frombuffer(iterations.columns()[i], dtype)
        return np.fromiter(map(itemgetter(i), iterations), dtype, n)

    predicted = column(2, float)
    chunks = column(4, int)
    p50, p90, p99 = np.percentile(predicted, PERCENTILES).tolist()
    return {
        "n": n,
        "predicted_s": {"mean": float(predicted.mean()), "p50": p50, "p90": p90, "p99": p99},
        "mean_decodes": float(column(3, int).mean()),
        "mean_prefill_chunks": float(chunks.mean()),
        "mean_prefill_tokens": float(column(5, int).mean()),
        "with_prefill_fraction": float((chunks > 0).mean()),
        "multi_prefill_fraction": float((chunks > 1).mean()),
    }


def _throughput(
    records: Sequence[RequestRecord],
    done: Sequence[RequestRecord],
    iterations: Sequence[IterationRecord],
    num_stages: int,
) -> dict[str, float | None]:
    if not done:
        return {"makespan_s": None, "requests_per_s": None, "tokens_per_s": None}
    start = min(r.arrival_s for r in records)
    end = max(r.finish_s for r in done if r.finish_s is not None)
    span = max(end - start, 1e-12)
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    if isinstance(iterations, IterationLog):  # the same floats summed in the same order
        busy = sum(iterations.predicted_s) / num_stages
    else:
        busy = sum(it.predicted_s for it in iterations) / num_stages
    return {
        "makespan_s": span,
        "requests_per_s": len(done) / span,
        "tokens_per_s": (prompt_tokens + out_tokens) / span,
        "output_tokens_per_s": out_tokens / span,
        "stage_utilization": busy / span,
    }


def write_requests(path: Path, records: Iterable[RequestRecord], long_threshold: int) -> None:
    """``requests.jsonl``: one line per input request, in input order."""
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_json(long_threshold), separators=(",", ":")))
            f.write("\n")


def write_iterations(path: Path, iterations: Iterable[IterationRecord]) -> None:
    """``iterations.csv``: one row per issued batch (the fields of :class:`IterationRecord`)."""
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(IterationRecord._fields)
        if isinstance(iterations, IterationLog):
            w.writerows(zip(*iterations.columns(), strict=True))
        else:
            w.writerows(iterations)


def read_requests(path: Path) -> list[dict[str, object]]:
    """Read back ``requests.jsonl`` (for plotting)."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
