"""``LLM(step_log=...)``: one record per batch, consistent with the engine's counters."""

from __future__ import annotations

import json
import os
from itertools import pairwise

import pytest

from medha_runtime import LLM, SamplingParams
from medha_runtime.step_log import (
    StepRecord,
    check_predictions,
    initial_model_path,
    read_step_log,
    step_overheads,
)
from medha_sched import AffineCostModel
from medha_sched.cost import BatchWork
from medha_sched.cost.online import OnlineCostModel

COST = AffineCostModel(base=1e-3, per_token=1e-5, per_attn=1e-9)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_records_match_the_engine(tmp_path):
    path = tmp_path / "steps.jsonl"
    prompts = [[5 + i for i in range(n)] for n in (7, 40, 133)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # no prefix caching: the prompts share a prefix, and every prompt token is counted below
    kw = dict(chunk_size=32, policy="fcfs", step_log=path, enable_prefix_caching=False)
    with LLM("tiny", cost_model=COST, **kw) as llm:
        llm.generate(prompts, params)
        stats = llm.engine.stats
    records = read_step_log(path)
    assert len(records) == stats.steps
    assert [r.step for r in records] == sorted({r.step for r in records})
    assert all(b.start_s >= a.start_s + a.execute_s for a, b in pairwise(records))
    assert all(r.execute_s > 0 and r.schedule_s >= 0 and r.finish_s >= 0 for r in records)
    assert all(
        r.predicted_s == pytest.approx(COST.predict(BatchWork.single_group(*r.items)), abs=1e-6)
        for r in records
    )
    # every prompt token is prefilled once, at most 32 tokens a batch; decodes are 1 token
    total = sum(r.num_tokens for r in records)
    assert total == stats.prefill_tokens + stats.decode_tokens == sum(map(len, prompts)) + 3 * 5
    assert max(r.num_tokens for r in records) == 32
    assert all(len(r.requests) == len(r.items) for r in records)
    assert len({rid for r in records for rid in r.requests}) == len(prompts)
    starts = sorted(kv for r in records for q, kv in r.items if q > 1)
    assert starts[:3] == [0, 0, 0]
    check = check_predictions(COST, records)
    assert check.steps == len(records)
    assert check.predicted_s == pytest.approx(sum(r.predicted_s for r in records), abs=1e-5)
    assert check.measured_s == pytest.approx(sum(r.execute_s for r in records))
    twice = AffineCostModel(base=2e-3, per_token=2e-5, per_attn=2e-9)
    assert check_predictions(twice, records).median_ratio == pytest.approx(check.median_ratio / 2)
    with pytest.raises(ValueError, match="empty"):
        check_predictions(COST, [])


def test_bad_lines_and_paths_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = StepRecord(
        step=1, start_s=0, schedule_s=0, execute_s=0.1, finish_s=0, predicted_s=0.1, items=((1, 3),)
    )
    bad.write_text(json.dumps(good.to_dict()) + "\n" + '{"step": 2}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a step record"):
        read_step_log(bad)
    with pytest.raises(ValueError, match="cannot write the step log"):
        LLM("tiny", cost_model=COST, step_log=tmp_path / "no" / "such" / "dir.jsonl")


def _rec(step: int, start: float, execute: float) -> StepRecord:
    return StepRecord(
        step=step,
        start_s=start,
        schedule_s=0.001,
        execute_s=execute,
        finish_s=0.001,
        predicted_s=execute,
        items=((1, 10),),
    )


def test_overheads_skip_idle_gaps():
    # back-to-back steps 0.1 s apart with 0.08 s in the executor, then an idle second
    recs = [_rec(i, 0.1 * i, 0.08) for i in range(5)] + [_rec(5, 1.5, 0.08), _rec(6, 1.6, 0.08)]
    o = step_overheads(recs)
    assert o.steps == 5  # the step before the idle gap is left out
    assert o.median_s == pytest.approx(0.02)
    assert o.execute_share == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no back-to-back steps"):
        step_overheads(recs[4:6])


def test_spp_records_measure_the_stage_sum(tmp_path):
    """With SPP > 1 each record holds the stages' own seconds, and the error is
    measured against their sum (what the cost model learns), not the wall time."""
    rec = StepRecord(
        step=3, start_s=0, schedule_s=0, execute_s=0.5, finish_s=0, predicted_s=0.3,
        items=((1, 3),), stage_s=(0.1, 0.15),
    )  # fmt: skip
    assert rec.measured_s == pytest.approx(0.25)
    assert rec.error == pytest.approx(0.05 / 0.25)
    back = StepRecord.from_dict(rec.to_dict())
    assert back == rec
    plain = StepRecord.from_dict({k: v for k, v in rec.to_dict().items() if k != "stage_s"})
    assert plain.stage_s == () and plain.error == pytest.approx(0.2 / 0.5)
    path = tmp_path / "spp.jsonl"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5 + i for i in range(n)] for n in (9, 70)]
    with LLM("tiny", spp=2, cost_model=COST, chunk_size=32, step_log=path) as llm:
        llm.generate(prompts, params)
    records = read_step_log(path)
    assert records and all(len(r.stage_s) == 2 and min(r.stage_s) > 0 for r in records)
    for r in records:
        assert r.error == pytest.approx(abs(r.predicted_s - sum(r.stage_s)) / sum(r.stage_s))
    check = check_predictions(COST, records)
    assert check.measured_s == pytest.approx(sum(sum(r.stage_s) for r in records))


def test_an_online_model_is_saved_as_it_started_the_log(tmp_path):
    """Beside a step log, the engine saves its online model before the first step:
    loaded back, it prices the log's first batch exactly as the server did."""
    path = tmp_path / "steps.jsonl"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM("tiny", chunk_size=32, step_log=path) as llm:  # online: calibrated at start
        assert isinstance(llm.engine.cost_model, OnlineCostModel)
        llm.generate([[5 + i for i in range(40)]], params)
        live = llm.engine.cost_model
    records = read_step_log(path)
    first = OnlineCostModel.load(initial_model_path(path))
    # saved before the first step: it has judged no step, the live model has (a
    # step it judged may still be ignored as an outlier, so its coefficients can
    # stay where they started on a loaded machine)
    assert live.median_error is not None and len(live.errors) == len(records)
    assert first.steps == 0 and first.median_error is None and not first.errors
    assert first.predict(BatchWork.single_group(*records[0].items)) == pytest.approx(
        records[0].predicted_s,
        abs=1e-6,  # the log keeps microseconds
    )
    with LLM("tiny", cost_model=COST, step_log=tmp_path / "affine.jsonl") as llm:
        llm.generate([[1, 2, 3]], params)
    assert not os.path.exists(initial_model_path(tmp_path / "affine.jsonl"))  # not online
