"""The simulator is opt-in: importing medha_sched does not load it or its dependencies."""

from __future__ import annotations

import subprocess
import sys


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(proc.stdout.split())


def test_medha_sched_does_not_import_the_simulator() -> None:
    mods = loaded_after("import medha_sched")
    assert not {m for m in mods if m.startswith("medha_sched.sim")}
    assert "numpy" not in mods and "tqdm" not in mods


def test_the_simulator_imports_matplotlib_only_to_plot() -> None:
    mods = loaded_after("import medha_sched.sim, medha_sched.sim.cli, medha_sched.sim.compare")
    assert "medha_sched.sim.engine" in mods
    assert "matplotlib" not in mods
