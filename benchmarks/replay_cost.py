"""Replay step logs through the online cost model, offline: no server, seconds per log.

A step log (``medha-runtime serve --step-log``; ``benchmarks/budget.py`` writes
``<run>.steps.jsonl``) holds each executed batch's work items (query tokens,
KV tokens cached before) and its measured executor seconds. This feeds them,
in order, through a fresh :class:`~medha_sched.cost.online.OnlineCostModel`
(as ``CostFeedback.record`` does: one KVP group, every item a tail item, the
fixed cost capped at T/2 of the step's budget) and reports the relative
prediction error ``|predicted - measured| / measured`` of each step's
prediction made before it was learned from:

- median and p90 after the first ``--skip`` steps, and before/after the CPU
  hog when the log's ``results.json`` (from ``budget.py``) says when it began;
- the errors the server itself logged (``live``), for comparison;
- per kind of step (decodes of <= 3 requests, chunks <= 128 tokens, longer
  chunks), the predicted total over the measured total (the model fits the
  mean step time: near 1 is unbiased);
- microseconds per ``observe`` (pure Python).

The initial coefficients are, by default (``--init auto``), those of the
model the server started the log with (``<log>.initial.json``, which the
engine saves beside a step log when its cost model is online; logs written
before 2026-11-26 noon have none), else the first step's logged prediction as
a constant (``--init first``), given
(``--init STEP,PER_REQUEST,PER_TOKEN,PER_KV,PER_ATTN`` seconds per unit), or a
saved model's (``--init FILE.json``, e.g. a run's ``<run>.online.json``: its
coefficients only, learned from in a fresh model). From the constant the
shared fit's ``per_attn`` stayed 100x low in two issue-18 hog logs (the long
prompt's 32-token chunks do not separate it), so the errors read higher than
live, where the server starts from its calibration.

    python benchmarks/replay_cost.py /tmp/budget/hog.steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from medha_runtime.step_log import initial_model_path, read_step_log
from medha_sched.cost import BatchWork, RequestWork
from medha_sched.cost.online import OnlineCostModel


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (as ``budget.py`` reports)."""
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def hog_step(path: str) -> int | None:
    """Index of the first step after the hog began, from ``results.json`` beside the log.

    Only for the run that had a hog: ``budget.py`` writes ``<run>.steps.jsonl``
    and the run's results under ``<run>`` in one ``results.json``, so a quiet
    run's log beside a hog run's is not split at the hog run's onset."""
    name = os.path.basename(path)
    run = name[: -len(".steps.jsonl")] if name.endswith(".steps.jsonl") else None
    try:
        with open(os.path.join(os.path.dirname(path), "results.json"), encoding="utf-8") as f:
            res = json.load(f)[run]
        return int(res["steps"]) - int(res["steps_after_hog"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def kind(items: tuple[tuple[int, int], ...]) -> str:
    q = sum(n for n, _ in items)
    return "decode" if q <= 3 else ("chunk<=128" if q <= 128 else "chunk>128")


def replay(path: str, init: str, skip: int) -> dict:
    records = read_step_log(path)
    if not records:
        raise SystemExit(f"{path}: empty step log")
    if init == "auto":  # the model the server started the log with, where it saved one
        saved = initial_model_path(path)
        init = saved if os.path.exists(saved) else "first"
    if init == "first":
        coef = (records[0].predicted_s, 0.0, 0.0, 0.0, 0.0)
    elif init.endswith(".json"):
        coef = tuple(OnlineCostModel.load(init).coefficients.values())
    else:
        coef = tuple(float(v) for v in init.split(","))
    model = OnlineCostModel(coef)
    errors: list[float] = []
    sums: dict[str, list[float]] = {}
    spent = 0.0
    for i, r in enumerate(records):
        if r.target_s > 0 and model.fixed_cost_cap != 0.5 * r.target_s:
            model.cap_fixed_cost(0.5 * r.target_s)  # as CostFeedback.record does
        batch = BatchWork(groups=(tuple(RequestWork(q, kv, True) for q, kv in r.items),))
        predicted = model.predict(batch)
        t0 = time.perf_counter()
        err = model.observe(batch, r.measured_s)
        spent += time.perf_counter() - t0
        errors.append(float("nan") if err is None else err)
        if i >= skip:
            s = sums.setdefault(kind(r.items), [0.0, 0.0, 0])
            s[0] += predicted
            s[1] += r.measured_s
            s[2] += 1
    hog = hog_step(path)
    out = {
        "steps": len(records),
        "median": statistics.median(errors[skip:]) if errors[skip:] else float("nan"),
        "p90": pct(errors[skip:], 90),
        "live_median": statistics.median(r.error for r in records[skip:])
        if records[skip:]
        else float("nan"),
        "live_p90": pct([r.error for r in records[skip:]], 90),
        "hog_step": hog,
        "drifts": model.drifts,
        "us_per_observe": 1e6 * spent / len(records),
        "bias": {k: (p / m, n) for k, (p, m, n) in sorted(sums.items())},
        "coefficients": model.coefficients,
    }
    if hog is not None:
        before, after = errors[skip:hog], errors[hog:]
        out["before_hog"] = (statistics.median(before), pct(before, 90)) if before else None
        out["after_hog"] = (statistics.median(after), pct(after, 90)) if after else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="step logs (JSON lines)")
    ap.add_argument(
        "--init",
        default="auto",
        help="'auto' (<log>.initial.json if there, else 'first'), 'first', five "
        "coefficients (comma-separated) or a saved model's FILE.json",
    )
    ap.add_argument("--skip", type=int, default=50, help="steps left out of the error statistics")
    ap.add_argument("--json", action="store_true", help="one JSON object per log")
    args = ap.parse_args()
    for path in args.logs:
        res = replay(path, args.init, args.skip)
        if args.json:
            print(json.dumps({"log": path, **res}))
            continue

        def pc(v: float) -> str:
            return f"{100 * v:.1f}%"

        line = (
            f"{path}: {res['steps']} steps; error after {args.skip}: median {pc(res['median'])}"
            f" p90 {pc(res['p90'])} (live {pc(res['live_median'])} / {pc(res['live_p90'])})"
        )
        for name in ("before_hog", "after_hog"):
            if res.get(name):
                med, p90 = res[name]
                line += f"; {name.replace('_', ' ')} {pc(med)} / {pc(p90)}"
        bias = ", ".join(f"{k} {r:.2f} (n={n})" for k, (r, n) in res["bias"].items())
        line += f"; predicted/measured totals: {bias}; drifts {res['drifts']}"
        line += f"; {res['us_per_observe']:.1f} us/observe"
        print(line)


if __name__ == "__main__":
    main()
