"""This installation's Medha version (for ``GET /version`` and the multi-node check-in)."""

from __future__ import annotations


def medha_version() -> str:
    """The installed ``medha`` package's version (``"unknown"`` when run from a source
    tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("medha")
    except PackageNotFoundError:
        return "unknown"
