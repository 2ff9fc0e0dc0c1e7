"""Imports go one way: runtime -> {sched, parallel, kernels}; parallel -> kernels.

medha_sched (apart from its simulator subpackage) imports no torch, no numpy
and no other medha package. Checked by parsing every module's imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ALLOWED = {
    "medha_sched": set(),
    "medha_kernels": set(),
    "medha_parallel": {"medha_kernels"},
    "medha_runtime": {"medha_sched", "medha_parallel", "medha_kernels"},
}
SCHED_FORBIDDEN_THIRD_PARTY = {"torch", "numpy", "triton"}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def modules(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


def test_every_layer_has_modules() -> None:
    for package in ALLOWED:
        assert modules(package), f"no modules found for {package}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layers_import_one_way(package: str) -> None:
    bad = []
    for path in modules(package):
        others = {r for r in imported_roots(path) if r.startswith("medha") and r != package}
        if others - ALLOWED[package]:
            bad.append(f"{path.relative_to(SRC)} imports {sorted(others - ALLOWED[package])}")
    assert not bad, "imports against the layer direction:\n" + "\n".join(bad)


def test_sched_core_has_no_tensor_dependencies() -> None:
    bad = []
    for path in modules("medha_sched"):
        if "sim" in path.relative_to(SRC / "medha_sched").parts[:-1]:
            continue
        found = imported_roots(path) & SCHED_FORBIDDEN_THIRD_PARTY
        if found:
            bad.append(f"{path.relative_to(SRC)} imports {sorted(found)}")
    assert not bad, "medha_sched core must stay pure Python:\n" + "\n".join(bad)


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import torch\nfrom medha_runtime.x import y\nfrom . import z\n")
    assert imported_roots(module) == {"torch", "medha_runtime"}
