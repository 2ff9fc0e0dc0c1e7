"""The README and docs/ stay true: named paths exist, links resolve, environment
variables read by the code are documented and documented ones are read.

``docs/benchmarks.md`` is a dated log (paths and variables of past runs), so it
is neither checked nor counted as documentation here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"),
]

#: a repository path as the docs quote it: `src/...`, `benchmarks/...`, ...
_PATH = re.compile(r"(?<![\w/.$~-])((?:src|benchmarks|examples|tests|docs|\.ci)/[\w./-]*[\w/])")
#: a Markdown link or image, [text](target) or ![text](target)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: how the code reads a variable: os.environ.get / os.environ[...] / os.getenv /
#: medha_kernels.native.cpu_module(opt_out) / ENV = "..." (read through ENV) / ${NAME in bash
_READ_PY = re.compile(
    r"""(?:environ(?:\.get)?\s*[(\[]\s*|getenv\(\s*|cpu_module\(\s*|\bENV\s*=\s*)["'](MEDHA_[A-Z0-9_]+)["']"""
)
_READ_SH = re.compile(r"\$\{?(MEDHA_[A-Z0-9_]+)")
_NAMED = re.compile(r"MEDHA_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])")
#: read by the code but set only by other code, never by a user
INTERNAL = {"MEDHA_OUTCOMES"}  # gpu_suite.py -> its own pytest plugin (benchmarks/pytest_outcomes)


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def read_variables() -> dict[str, set[str]]:
    """MEDHA_* variable -> files (relative) that read it, over src/, benchmarks/, tests/."""
    found: dict[str, set[str]] = {}
    for top in ("src", "benchmarks", "tests", "examples"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix == ".py":
                names = _READ_PY.findall(path.read_text(encoding="utf-8"))
            elif path.suffix == ".sh":
                names = _READ_SH.findall(path.read_text(encoding="utf-8"))
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(_doc_id(path))
    return found


def documented_variables() -> dict[str, set[str]]:
    """MEDHA_* variable -> docs that name it (a trailing ``_*`` glob names none)."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        for name in _NAMED.findall(doc.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(_doc_id(doc))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading's text."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    inside_code = False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside_code = not inside_code
            continue
        m = re.match(r"#{1,6} (.+)", line)
        if m is None or inside_code:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_quoted_path_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = sorted({p for p in _PATH.findall(text) if not (ROOT / p.rstrip(".")).exists()})
    assert not missing, f"{_doc_id(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_link_resolves(doc: Path) -> None:
    bad = []
    for target in _LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not bad, f"{_doc_id(doc)}: {bad}"


def test_every_variable_the_code_reads_is_documented() -> None:
    read, documented = read_variables(), documented_variables()
    assert "MEDHA_CACHE_DIR" in read and "MEDHA_CPU_HUGE_PAGES" in read  # the scan works
    undocumented = sorted(
        f"{name} (read in {', '.join(sorted(files))})"
        for name, files in read.items()
        if name not in documented and name not in INTERNAL
    )
    assert not undocumented, f"not in README.md or docs/ (benchmarks.md aside): {undocumented}"


def test_every_documented_variable_is_read() -> None:
    read, documented = read_variables(), documented_variables()
    stale = sorted(
        f"{name} (named in {', '.join(sorted(files))})"
        for name, files in documented.items()
        if name not in read
    )
    assert not stale, f"documented, but no code reads them: {stale}"


def test_quick_start_installs_as_ci_does() -> None:
    """The quick start's install steps are the CI command's, with the `serve` extra."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    serve = next(b.strip() for b in blocks if "medha-runtime serve smollm2" in b)
    ci = text.split("<!-- ci:test-command -->", 1)[1]
    test = re.search(r"```bash\n(.*?)```", ci, flags=re.S).group(1).strip()
    install = 'python3 -m pip install -q torch==2.13.0 && python3 -m pip install -q -e ".['
    assert serve.startswith(install + 'serve]" && '), serve
    assert test.startswith(install + 'test]" && '), test
