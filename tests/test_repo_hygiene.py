"""Lint and examples: what CI must keep green besides the unit tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _ruff() -> list[str]:
    exe = shutil.which("ruff")
    return [exe] if exe else [sys.executable, "-m", "ruff"]


def test_ruff_check_passes() -> None:
    proc = subprocess.run([*_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean() -> None:
    cmd = [*_ruff(), "format", "--check", "."]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_there_are_examples() -> None:
    assert EXAMPLES, "examples/ must hold a runnable example per layer"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(example)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"{example.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{example.name} printed nothing"


def test_readme_python_snippets_run() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert blocks, "README must show a Python example"
    for block in blocks:
        proc = subprocess.run(
            [sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"README snippet failed:\n{block}\n{proc.stderr}"


def test_ci_runs_exactly_the_readme_test_command() -> None:
    """.ci/run runs the README's marked block in a fresh venv; the block is the test command."""
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "readme-test-command")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    command = proc.stdout.strip()
    assert command.splitlines() == [command], "the README's test command is one line"
    assert "pip install -q torch==2.13.0" in command, command
    assert command.endswith("pytest -q -n 2 --dist loadfile"), command
    ci = (ROOT / ".ci" / "run").read_text()
    assert "command=$(bash .ci/readme-test-command)" in ci
    assert "python3 -m venv .venv-ci" in ci and "source .venv-ci/bin/activate" in ci


def test_dependencies_have_lower_bounds_and_only_torch_is_pinned_by_the_readme() -> None:
    """Every third-party dependency names the lowest version it needs; none is pinned."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += [r for r in extra if not r.startswith("medha[")]
    assert requirements
    for req in requirements:
        assert "==" not in req, f"{req}: pin nothing exactly (torch is pinned by the README only)"
        assert ">=" in req, f"{req}: give the lowest version it really needs"
    assert "pip install -q torch==2.13.0" in (ROOT / "README.md").read_text()


def test_the_quick_start_extra_covers_every_command_the_readme_shows() -> None:
    """Server, GGUF models, bench --plot (matplotlib) and medha-sim all come with it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    readme = (ROOT / "README.md").read_text()
    quick = next(line for line in readme.splitlines() if "medha-runtime serve smollm2" in line)
    assert '-e ".[serve]"' in quick, quick
    assert set(extras["serve"]) >= {"medha[runtime]", "medha[gguf]", "medha[sim]"}
    assert any(r.startswith("matplotlib") for r in extras["sim"])  # bench --plot
    assert any(r.startswith("gguf") for r in extras["gguf"])
