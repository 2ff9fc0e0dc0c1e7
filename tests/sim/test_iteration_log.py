"""IterationLog (the simulator's batches kept as columns) against a plain list of
IterationRecord: same items, same summary, same iterations.csv bytes."""

from __future__ import annotations

import random

import pytest

from medha_sched.sim import TraceRequest, simulate
from medha_sched.sim.metrics import (
    IterationLog,
    IterationRecord,
    IterationRows,
    summarize,
    write_iterations,
)
from medha_sched.sim.runner import RunSpec


def _records(n: int, seed: int = 0) -> list[IterationRecord]:
    rng = random.Random(seed)
    return [
        IterationRecord(
            i + rng.randrange(3),
            rng.random() * 1e4,
            rng.random() * 0.05,
            rng.randrange(300),
            rng.randrange(3),
            rng.randrange(70000),
            rng.randrange(2),
        )
        for i in range(n)
    ]


def test_log_is_the_list() -> None:
    rows = _records(500)
    log = IterationLog(rows)
    assert len(log) == 500
    assert log == rows and rows == log and log == IterationLog(rows)
    assert list(log) == rows
    assert log[0] == rows[0] and log[-1] == rows[-1] and log[123] == rows[123]
    assert type(log[7]) is IterationRecord and log[7].tokens == rows[7].tokens
    assert log[10:20] == rows[10:20] and log[::-7] == rows[::-7]
    assert [type(v) for v in log[3]] == [type(v) for v in rows[3]]
    other = IterationLog(rows)
    other.append(*rows[0])
    assert other != log and log != rows[:-1]
    changed = list(rows)
    changed[250] = changed[250]._replace(predicted_s=changed[250].predicted_s + 1e-12)
    assert log != changed and log != IterationLog(changed)


def test_extend_is_append() -> None:
    rows = _records(300, seed=1)
    one, bulk = IterationLog(), IterationLog()
    for r in rows:
        one.append(*r)
    bulk.extend(*(list(c) for c in zip(*rows[:100], strict=True)))
    bulk.extend(*(iter(c) for c in zip(*rows[100:], strict=True)))
    assert bulk == one == rows
    before = list(bulk)
    with pytest.raises(ValueError, match="different lengths"):
        bulk.extend([1, 2], [0.0, 1.0], [0.1, 0.2], [1, 1], [0, 0], [0, 0], [0])
    assert bulk == before


def test_summary_and_csv_same_as_list(tmp_path) -> None:
    trace = [
        TraceRequest(f"r{i}", 0.3 * i, 200 + 4000 * (i % 5 == 0) + 37 * i, 5 + (i % 9) * 40)
        for i in range(40)
    ]
    spec = RunSpec(cost_model="roofline:model=llama3-8b,gpu=a100", tp=8, spp=2)
    config, model, cache = spec.build()
    result = simulate(trace, config, model, cache=cache)
    log = result.iterations
    assert isinstance(log, IterationLog) and len(log) > 100
    rows = list(log)
    assert summarize(result.records, log, long_threshold=2000, num_stages=2) == summarize(
        result.records, rows, long_threshold=2000, num_stages=2
    )
    write_iterations(tmp_path / "log.csv", log)
    write_iterations(tmp_path / "rows.csv", rows)
    assert (tmp_path / "log.csv").read_bytes() == (tmp_path / "rows.csv").read_bytes()


def test_a_refused_value_leaves_the_log_as_it_was() -> None:
    log = IterationLog()
    log.append(0, 0.0, 0.1, 1, 0, 0, 0)
    with pytest.raises(TypeError):
        log.append(1, 0.5, 0.1, 2.5, 0, 0, 0)  # decodes: an int column
    with pytest.raises(TypeError):
        log.extend([1, 2], [0.5, 0.6], [0.1, 0.1], [1, 1], [0, 0.5], [0, 0], [0, 0])
    assert [len(col) for col in log.columns()] == [1] * 7
    assert list(log) == [IterationRecord(0, 0.0, 0.1, 1, 0, 0, 0)]


def test_extend_packs_lists_as_fromlist() -> None:
    """Lists go in by ``struct`` (the same bytes as ``fromlist``); values it refuses
    go the ``fromlist`` way: ints in float columns, bools and index-able ints, and
    the errors of a float in an int column or an int past int64."""
    one, bulk = IterationLog(), IterationLog()
    rows = [(7, 1, 2**60, True, 0, 3, False), (8, 0.5, -0.0, 2**63 - 1, -(2**63), 0, 1)]
    for r in rows:
        one.append(*r)
    bulk.extend(*(list(c) for c in zip(*rows, strict=True)))
    assert bulk == one and bulk.columns() == one.columns()
    assert bulk[0].start_s == 1.0 and type(bulk[0].start_s) is float
    before = list(bulk)
    with pytest.raises(TypeError):
        bulk.extend([1], [0.0], [0.1], [1.5], [0], [0], [0])
    with pytest.raises(OverflowError):
        bulk.extend([1], [0.0], [0.1], [2**63], [0], [0], [0])
    with pytest.raises(TypeError):
        bulk.extend([1], ["x"], [0.1], [1], [0], [0], [0])
    assert bulk == before


def test_extend_ids_as_ranges() -> None:
    """A range of ids goes in as one copy where numpy holds it exactly, else as
    ``extend`` takes it (steps, bounds past 2**52, past int64: the same error)."""
    log, want = IterationLog(), []
    for ids in (range(5, 9), range(0), range(9, 3), range(10, 20, 3), range(2**53, 2**53 + 2)):
        n = len(ids)
        log.extend(ids, [0.0] * n, [0.0] * n, [0] * n, [0] * n, [0] * n, [0] * n)
        want.extend(ids)
    assert list(log.batch_id) == want
    with pytest.raises(OverflowError):
        log.extend(range(2**63, 2**63 + 1), [0.0], [0.0], [0], [0], [0], [0])
    assert list(log.batch_id) == want


@pytest.mark.parametrize("block", [1, 7, 64, 10_000])
def test_rows_gathered_are_the_log(block: int) -> None:
    """IterationRows: appends and extends (lists, ranges, arrays) gathered and
    moved in blocks give the log direct calls give, in the same order; rows
    move on their own once ``block`` are gathered, the rest at ``flush``."""
    rows = _records(400, seed=2)
    direct, log = IterationLog(), IterationLog()
    gathered = IterationRows(log, block)
    i = 0
    rng = random.Random(block)
    while i < len(rows):
        k = rng.randrange(1, 20)
        part = rows[i : i + k]
        cols = [list(c) for c in zip(*part, strict=True)]
        if k == 1:
            direct.append(*part[0])
            gathered.append(*part[0])
        else:
            if rng.random() < 0.5:  # the ids as a range where they are one
                cols[0] = range(part[0][0], part[0][0] + len(part))
                part = [r._replace(batch_id=cols[0][j]) for j, r in enumerate(part)]
                rows[i : i + k] = part
            direct.extend(*cols)
            gathered.extend(*cols)
        assert len(log) + len(gathered) == len(direct)
        assert len(gathered) < block
        i += k
    gathered.flush()
    assert len(gathered) == 0
    assert log == direct == rows
    assert log.columns() == direct.columns()  # the same bytes, column by column


def test_rows_refuse_as_the_log() -> None:
    """A length mismatch raises at ``extend`` and gathers nothing; a value a
    column refuses raises at the flush that moves it, the log unchanged (or
    at an append that goes straight in)."""
    log = IterationLog()
    gathered = IterationRows(log, 100)
    gathered.extend([1, 2], [0.0, 1.0], [0.1, 0.2], [1, 1], [0, 0], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="different lengths"):
        gathered.extend([3, 4], [0.0, 1.0], [0.1, 0.2], [1, 1], [0, 0], [0, 0], [0])
    assert len(gathered) == 2
    gathered.append(3, 2.0, 0.3, 1.5, 0, 0, 0)  # a float where an int goes
    with pytest.raises(TypeError):
        gathered.flush()
    assert len(log) == 0 and len(gathered) == 3
    empty = IterationRows(log, 100)  # nothing gathered: an append goes straight in
    with pytest.raises(TypeError):
        empty.append(3, 2.0, 0.3, 1.5, 0, 0, 0)
    assert len(log) == 0 and len(empty) == 0
    empty.append(3, 2.0, 0.3, 1, 0, 0, 0)
    assert len(log) == 1 and len(empty) == 0
