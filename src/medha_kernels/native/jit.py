"""Build the native extension (merges, CPU attention) on first use and keep it on disk.

``get_module(device_type)`` compiles ``csrc/`` with ``torch.utils.cpp_extension.load``
(ninja) the first time a process needs it and caches the module for the
process. The build lives in::

    $MEDHA_CACHE_DIR/native/<torch version>-<hash>/

(``MEDHA_CACHE_DIR`` defaults to ``$XDG_CACHE_HOME/medha``, else ``~/.cache/medha``)

where the hash covers the sources, the flags, the compiler, the Python tag and,
for CUDA, the target architectures (see :func:`build_directory`). A finished build leaves a
marker file next to the library; a later process that finds both loads the
library directly without invoking ninja or the compiler. Concurrent first
builds are serialised by torch's lock file in the build directory.

Nothing here runs at import time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("medha_kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
_CPU_FILES = (
    "merge.h",
    "attention.h",
    "linear.h",
    "norm.h",
    "argmax.h",
    "rotary.h",
    "bindings.cpp",
    "merge_cpu.cpp",
    "attention_cpu.cpp",
    "linear_cpu.cpp",
    "norm_cpu.cpp",
    "argmax_cpu.cpp",
    "rotary_kv_cpu.cpp",
)
SOURCES = {"cpu": _CPU_FILES, "cuda": (*_CPU_FILES, "merge_cuda.cu")}
_MARKER = ".medha_built"
_LIB_EXT = ".pyd" if sys.platform == "win32" else ".so"


@dataclass(frozen=True)
class LoadInfo:
    """How ``get_module`` obtained a module: ``built`` (compiled now) or loaded from cache."""

    device_type: str
    built: bool
    seconds: float
    library: Path


_LOADS: dict[str, LoadInfo] = {}


def load_info(device_type: str) -> LoadInfo | None:
    """What the first ``get_module(device_type)`` of this process did, if it ran."""
    return _LOADS.get(device_type)


def cache_root() -> Path:
    """``$MEDHA_CACHE_DIR``, else ``$XDG_CACHE_HOME/medha``, else ``~/.cache/medha``
    (``~`` expanded): where ``medha_runtime`` keeps fetched models too."""
    if os.environ.get("MEDHA_CACHE_DIR"):
        return Path(os.environ["MEDHA_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "medha"


def cxx_available() -> bool:
    """A C++ compiler as ``torch.utils.cpp_extension`` would pick it (``$CXX`` or ``c++``)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def _ninja_dir() -> str | None:
    """Directory holding a ninja binary: on PATH, or the one the ``ninja`` wheel ships."""
    found = shutil.which("ninja")
    if found:
        return str(Path(found).parent)
    try:
        import ninja
    except ImportError:
        return None
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and any(Path(bin_dir, n).exists() for n in ("ninja", "ninja.exe")):
        return str(bin_dir)
    return None


def ninja_available() -> bool:
    return _ninja_dir() is not None


def _cuda_arch_key() -> str:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        return archs
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))


def _compiler_is_gcc() -> bool:
    try:
        out = subprocess.run(
            [os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    out = out.lower()
    return "clang" not in out and any(k in out for k in ("free software foundation", "gcc", "g++"))


def _openmp_wanted() -> bool:
    """Whether to compile with ``-fopenmp`` (if the compiler then proves to be GCC).

    ``at::parallel_for`` is an inline template: with torch's OpenMP backend it only
    spreads work across threads when the extension itself is compiled with
    ``-fopenmp``; without it the kernels run single-threaded. With GCC on Linux
    the extension's ``libgomp.so.1`` resolves to the copy torch has already
    loaded (one runtime, one pool, sized by ``torch.set_num_threads``), as for
    torch's own Inductor C++ code. ``MEDHA_NATIVE_OPENMP=0`` opts out.
    """
    return (
        os.environ.get("MEDHA_NATIVE_OPENMP", "1") != "0"
        and sys.platform.startswith("linux")
        and torch.backends.openmp.is_available()
    )


def _simd_flags() -> list[str]:
    """SIMD flags for this CPU (x86-64, as torch detects it), part of the cache key.

    ``-mavx2 -mfma`` where the CPU has AVX2; where torch reports AVX-512, also
    ``-mavx512f -mavx512vl -mavx512bw -mavx512dq`` (the linear kernel's column
    path uses 512-bit intrinsics) with ``-mprefer-vector-width=256`` so that the
    compiler's own auto-vectorisation (the attention kernel's loops) stays at the
    256-bit width it had. Elsewhere none. The kernels have AVX2 paths and
    portable fallbacks; the build is cached per machine.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return [
            "-mavx2",
            "-mfma",
            "-mavx512f",
            "-mavx512vl",
            "-mavx512bw",
            "-mavx512dq",
            "-mprefer-vector-width=256",
        ]
    return ["-mavx2", "-mfma"] if capability == "AVX2" else []


def _flags(device_type: str, openmp: bool) -> dict[str, list[str]]:
    omp = ["-fopenmp"] if openmp else []
    cflags = ["-O3", *_simd_flags(), *omp]
    cuda_cflags: list[str] = []
    if device_type == "cuda":
        cflags.append("-DMEDHA_WITH_CUDA")
        cuda_cflags = ["-O3", "-DMEDHA_WITH_CUDA"]
    return {"extra_cflags": cflags, "extra_cuda_cflags": cuda_cflags, "extra_ldflags": omp}


def build_directory(device_type: str) -> Path:
    """Where the extension for ``device_type`` is (or will be) built.

    The name hashes the sources' contents, the flags, the compiler (``$CXX``),
    the Python tag, torch's CUDA version and, for CUDA, the target architectures;
    the package's location is not part of it.
    """
    digest = hashlib.sha256()
    for name in SOURCES[device_type]:
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    key = [
        device_type,
        repr(sorted(_flags(device_type, _openmp_wanted()).items())),
        os.environ.get("CXX", "c++"),
        sys.implementation.cache_tag or "",
        platform.machine(),
        str(torch.version.cuda),
    ]
    if device_type == "cuda":
        key.append(_cuda_arch_key())
    digest.update("\0".join(key).encode())
    return cache_root() / "native" / f"{torch.__version__}-{digest.hexdigest()[:16]}"


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(device_type: str, name: str, build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    ninja_dir = _ninja_dir()
    if ninja_dir is None:
        raise RuntimeError("the native backend needs ninja (pip install ninja)")
    if not shutil.which("ninja"):  # torch runs `ninja` from PATH
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(CSRC / f) for f in SOURCES[device_type] if not f.endswith(".h")]
    logger.info("medha native: building %s kernels in %s (first use)", device_type, build_dir)
    try:
        module = cpp_extension.load(
            name=name,
            sources=sources,
            build_directory=str(build_dir),
            extra_include_paths=[str(CSRC)],
            verbose=os.environ.get("MEDHA_NATIVE_VERBOSE", "0") not in ("", "0"),
            **_flags(device_type, _openmp_wanted() and _compiler_is_gcc()),
        )
    except Exception as exc:
        raise RuntimeError(
            f"building the native {device_type} kernels in {build_dir} failed "
            f"(set MEDHA_NATIVE_VERBOSE=1 for the compiler output, or use backend='torch'): {exc}"
        ) from exc
    tmp = build_dir / f"{_MARKER}.{os.getpid()}"
    tmp.write_text(f"{torch.__version__}\n")
    tmp.replace(build_dir / _MARKER)  # atomic: the marker only ever names a finished build
    return module


@functools.cache
def get_module(device_type: str) -> ModuleType:
    """The compiled merge module for ``"cpu"`` or ``"cuda"``, built on first use."""
    if device_type not in SOURCES:
        raise ValueError(f"no native kernels for device type {device_type!r}")
    name = f"medha_merge_{device_type}"
    build_dir = build_directory(device_type)
    library = build_dir / f"{name}{_LIB_EXT}"
    start = time.perf_counter()
    cached = (build_dir / _MARKER).exists() and library.exists()
    module = _import_library(name, library) if cached else _build(device_type, name, build_dir)
    seconds = time.perf_counter() - start
    _LOADS[device_type] = LoadInfo(device_type, not cached, seconds, library)
    logger.debug("medha native: %s %s in %.2fs", "loaded" if cached else "built", library, seconds)
    return module
