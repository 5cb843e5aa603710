"""Installed package versions, from package metadata: no import of the package (vLLM's and SGLang's are heavy, and
a broken install must not fail the caller)."""

from __future__ import annotations

import importlib.metadata


def version(dist: str) -> str | None:
    """``dist``'s installed version, or None where it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
