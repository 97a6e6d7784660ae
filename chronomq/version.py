"""The version of chronomq: ``pyproject.toml``'s ``version``, the one place it is written, read
from the installed package's metadata.

A leaf module (it imports nothing of chronomq's), so every package may read it.
"""

from __future__ import annotations

from importlib import metadata
from typing import Final


def _installed() -> str:
    try:
        return metadata.version("chronomq")
    except metadata.PackageNotFoundError:  # a bare source tree, never installed
        return "unknown"


VERSION: Final = _installed()
"""This code's version, e.g. ``0.2.0`` (``unknown`` when chronomq is not installed)."""
