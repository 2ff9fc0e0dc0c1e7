"""Looking up a named preset."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup_preset(table: Mapping[str, T], name: object, what: str) -> T:
    """``table[name]``, or a ValueError naming the bad name and the known ones."""
    value = table.get(name) if isinstance(name, str) else None
    if value is None:
        known = ", ".join(sorted(table))
        raise ValueError(f"unknown {what} preset {name!r}; known: {known}")
    return value
