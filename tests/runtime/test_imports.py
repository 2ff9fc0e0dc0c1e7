"""medha_runtime runs models without transformers: it must never import it."""

from __future__ import annotations

import subprocess
import sys

from tests.test_import_direction import SRC, imported_roots


def test_no_module_imports_transformers() -> None:
    bad = [
        str(p.relative_to(SRC))
        for p in sorted((SRC / "medha_runtime").rglob("*.py"))
        if "transformers" in imported_roots(p)
    ]
    assert not bad, f"medha_runtime modules import transformers: {bad}"


def test_loading_tiny_does_not_pull_in_transformers() -> None:
    code = (
        "import sys; from medha_runtime.model import load_model; "
        "from medha_runtime.model.tiny import tiny_tokenizer; "
        "load_model('tiny'); tiny_tokenizer().encode('x'); "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
