"""Optional dependencies, checked before a command starts its work.

A console script or flag that needs an extra calls :func:`require` first, so
that a missing package is one line naming the extra to install, given at
once, not a traceback after minutes of work.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra."""


def missing_modules(modules: Iterable[str]) -> list[str]:
    """The modules of ``modules`` that fail to import (a broken install counts as missing)."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def require(modules: Iterable[str], *, extra: str, what: str = "") -> None:
    """Raise :class:`MissingExtra` unless every module in ``modules`` imports.

    Args:
        modules: importable module names, e.g. ``("matplotlib",)``.
        extra: the ``medha`` extra that installs them, e.g. ``"sim"``.
        what: the flag that needs them, e.g. ``"--plot"``; empty for a whole command.
    """
    missing = missing_modules(modules)
    if missing:
        subject = f"{what} needs" if what else "needs"
        raise MissingExtra(
            f"{subject} {', '.join(missing)}, which is not installed: pip install 'medha[{extra}]'"
        )
