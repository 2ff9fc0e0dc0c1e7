"""Kernel tests: without CUDA, Triton runs in its CPU interpreter."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
