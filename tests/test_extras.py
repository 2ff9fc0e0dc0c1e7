"""A missing optional dependency is one line naming the extra, given before any work.

A stub package shadows ``matplotlib`` and fails on import, as on a machine
without the ``sim`` extra; every command or flag that plots must say so at
once (exit status 2), not after running its simulations or benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medha_sched.extras import MissingExtra, missing_modules, require

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_matplotlib(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``import matplotlib`` raises ImportError."""
    stub = tmp_path / "stubs" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("matplotlib is blocked by a test stub")\n')
    path = os.pathsep.join([str(stub.parent), str(ROOT / "src")])
    return {**os.environ, "PYTHONPATH": path}


COMMANDS = {
    # A sweep of 7 variants x 4 loads over 10 simulated minutes: minutes of work if it started.
    "medha-sim compare": ["medha_sched.sim.cli", "compare", "--duration", "600", "--out", "cmp"],
    "medha-sim plot": ["medha_sched.sim.cli", "plot", "run-a", "--out", "x.png"],
    # Nothing listens on port 9: the benchmark would fail only after its warm-up.
    "medha-runtime bench --plot": [
        "medha_runtime",
        "bench",
        "--base-url",
        "http://127.0.0.1:9",
        "--num-prompts",
        "1000",
        "--plot",
        "x.png",
    ],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_plotting_without_matplotlib_fails_at_once(name, no_matplotlib, tmp_path) -> None:
    cmd = [sys.executable, "-m", *COMMANDS[name]]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=no_matplotlib, capture_output=True, text=True, timeout=60
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "matplotlib" in lines[0] and "pip install 'medha[sim]'" in lines[0], lines[0]
    assert not (tmp_path / "cmp").exists(), "compare started work before checking its extras"
    assert elapsed < 10.0, f"{name} took {elapsed:.2f} s to name the missing extra"


def test_require_names_every_missing_module_and_the_extra() -> None:
    assert missing_modules(["json", "medha_no_such_module_a"]) == ["medha_no_such_module_a"]
    with pytest.raises(MissingExtra, match=r"--flag needs medha_no_such_module_a, medha_no_"):
        names = ["json", "medha_no_such_module_a", "medha_no_such_module_b"]
        require(names, extra="x", what="--flag")
    with pytest.raises(MissingExtra, match=r"pip install 'medha\[sim\]'$"):
        require(["medha_no_such_module_a"], extra="sim")
    require(["json"], extra="sim")  # present: no error


def test_import_of_the_runtime_cli_and_sim_cli_needs_no_torch_or_numpy() -> None:
    code = (
        "import sys, medha_runtime, medha_runtime.cli, medha_sched.sim, medha_sched.sim.cli\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["serve", "profile"])
@pytest.mark.parametrize("model", ["smollm2", "model.gguf", "gguf-dir"])
def test_a_gguf_model_without_gguf_fails_at_once(command, model, tmp_path) -> None:
    """README: a missing extra is one line "before it starts any work". ``serve smollm2``
    without the gguf package bound its port, started uvicorn and the engine process,
    and only then failed (exit 1, about 5 s, after uvicorn's start-up lines)."""
    stub = tmp_path / "stubs" / "gguf"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("gguf is blocked by a test stub")\n')
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # exists: checked before the extras
    (tmp_path / "gguf-dir").mkdir()  # a directory of one .gguf and no config.json
    (tmp_path / "gguf-dir" / "m.gguf").write_bytes(b"GGUF")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(ROOT / "src")])}
    cmd = [sys.executable, "-m", "medha_runtime", command, model]
    cmd += ["--port", "0"] if command == "serve" else ["--out", str(tmp_path / "p.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    want = (
        f"medha-runtime {command}: error: the GGUF model {model} needs gguf, which is not "
        "installed: pip install 'medha[gguf]'"
    )
    assert proc.stderr.strip() == want


def test_the_cli_knows_every_packaged_gguf_model() -> None:
    from medha_runtime.cli import _GGUF_NAMES
    from medha_runtime.model.smollm2 import PACKAGED_MODELS

    assert set(_GGUF_NAMES) == set(PACKAGED_MODELS)
