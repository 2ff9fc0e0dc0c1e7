"""A pytest plugin for ``benchmarks/gpu_suite.py``: one JSON line per test outcome, as it comes.

Loaded with ``-p medha_outcomes`` (this folder on ``PYTHONPATH``); writes to
``$MEDHA_OUTCOMES``. The lines survive a run that is killed at its time limit,
unlike a JUnit XML file, which pytest writes only at the end. Under xdist only
the controller writes (the workers' reports reach it too).
"""

from __future__ import annotations

import json
import os

import pytest


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    text = getattr(report, "longreprtext", "") or str(longrepr or "")
    lines = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines()
    return "\n".join(lines[-6:])[:2000]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("MEDHA_OUTCOMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when != "call" and report.passed:
        return  # setup/teardown that passed: the call's report says it
    outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    row = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": outcome,
        "seconds": round(report.duration, 3),
    }
    if report.outcome != "passed":
        row["reason"] = _reason(report)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
