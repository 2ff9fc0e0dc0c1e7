"""glibc malloc settings for CPU steps: large buffers come from the heap and stay there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _glibc_mallinfo2() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")  # glibc >= 2.33
    except OSError:
        return False


GLIBC = pytest.mark.skipif(not _glibc_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")

PROBE = """
import ctypes, sys
import torch
from medha_runtime.cpu_memory import keep_freed_memory

FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in FIELDS.split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory()
before = libc.mallinfo2().hblkhd
t = torch.empty(16 << 20, dtype=torch.uint8)
t.fill_(1)
grew = libc.mallinfo2().hblkhd - before
print(applied, grew >= 16 << 20)
"""


def run_python(code: str, choice: str | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, with ``MEDHA_CPU_MALLOC=choice`` (unset: None)."""
    env = {k: v for k, v in os.environ.items() if k != "MEDHA_CPU_MALLOC"}
    if choice is not None:
        env["MEDHA_CPU_MALLOC"] = choice
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@GLIBC
def test_a_16_mib_buffer_comes_from_the_heap_not_mmap() -> None:
    proc = run_python(PROBE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"]  # applied; no new mmap for 16 MiB


@GLIBC
def test_default_leaves_glibc_alone() -> None:
    proc = run_python(PROBE, "default")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]  # not applied; glibc mmaps 16 MiB


def test_a_bad_setting_is_named(monkeypatch) -> None:
    from medha_runtime import cpu_memory

    monkeypatch.setenv("MEDHA_CPU_MALLOC", "fast")
    message = "MEDHA_CPU_MALLOC must be 'keep' or 'default', got 'fast'"
    with pytest.raises(ValueError, match=message):
        cpu_memory._apply()
    monkeypatch.setenv("MEDHA_CPU_MALLOC", "default")
    assert cpu_memory._apply() is False  # nothing applied, nothing raised


@GLIBC
def test_a_cpu_model_runner_applies_the_settings() -> None:
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from medha_runtime import cpu_memory\n"
        "from medha_runtime.runner import ModelRunner, RunnerSpec\n"
        "assert cpu_memory._done is None\n"
        "ModelRunner(RunnerSpec(model='tiny', dtype='float32', device='cpu', num_blocks=8,"
        " group_tokens=128))\n"
        "print(cpu_memory._done)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]
