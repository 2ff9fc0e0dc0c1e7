from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.checkpoints import SPECS, build_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoint(name) -> Path``: a transformers-written directory, built once per session."""
    pytest.importorskip("transformers")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = build_checkpoint(SPECS[name], tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (two-core CI machines run ranks side by side)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
