"""Backend registry: which implementations exist, which run here, and "auto".

Each backend is a subpackage exposing the ops it implements as functions with
already-validated arguments. Nothing is imported or compiled until an op is
first called with that backend.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger("medha_kernels")

BACKENDS = ("torch", "triton", "native", "flashinfer")
_MODULES = {
    "torch": "torch_ref",
    "triton": "triton",
    "native": "native",
    "flashinfer": "flashinfer_adapter",
}
OPS = (
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "chunked_prefill_attention",
    "paged_attention",
    "append_paged_kv",
)
# Fastest first, per device type.
_AUTO_ORDER = {
    "cuda": ("flashinfer", "triton", "native", "torch"),
    "cpu": ("native", "torch"),
}


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _module(backend: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"medha_kernels.{_MODULES[backend]}")
    except ImportError as exc:  # an optional dependency is missing
        logger.debug("backend %s unavailable: %s", backend, exc)
        return None


def _runs_on(backend: str, device: torch.device) -> bool:
    supports = getattr(_module(backend), "supports_device", None)
    return supports is not None and bool(supports(device))


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends usable here for ``device`` (default: CUDA if present, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    return [b for b in BACKENDS if _runs_on(b, dev)]


def resolve(op: str, backend: str, device: torch.device, args: tuple = ()):
    """The function implementing ``op`` on ``device`` for ``backend`` (or "auto").

    With "auto", a backend that declares ``can_run(op, *args)`` is skipped for
    inputs outside its limits (FlashInfer's head dims and dtypes, say).
    """
    name = resolve_name(op, backend, device, args)
    return _lookup(op, name, device)


def resolve_name(op: str, backend: str, device: torch.device, args: tuple = ()) -> str:
    """The backend that :func:`resolve` picks for ``op`` (its name)."""
    if backend == "auto":
        for name in _AUTO_ORDER.get(device.type, ("torch",)):
            fn = _lookup(op, name, device)
            if fn is not None and _accepts(name, op, args):
                logger.debug("auto backend for %s on %s: %s", op, device, name)
                return name
        raise ValueError(f"no backend implements {op} on {device}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if _lookup(op, backend, device) is None:
        usable = ", ".join(b for b in available_backends(device) if _lookup(op, b, device))
        raise ValueError(
            f"backend {backend!r} cannot run {op} on {device}; usable here: {usable or 'none'}"
        )
    return backend


def planner(op: str, backend: str):
    """Backend ``backend``'s ``plan_<op>`` (see :mod:`medha_kernels.plan`), or None."""
    return getattr(_module(backend), f"plan_{op}", None)


def _lookup(op: str, backend: str, device: torch.device):
    if not _runs_on(backend, device):
        return None
    return getattr(_module(backend), op, None)


def _accepts(backend: str, op: str, args: tuple) -> bool:
    check = getattr(_module(backend), "can_run", None)
    return check is None or bool(check(op, *args))
