"""Shared fixtures."""

from __future__ import annotations

import time

import psutil
import pytest


def live_children() -> list[psutil.Process]:
    # NOTE: multiprocessing's resource tracker lives as long as this process, by design.
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def assert_no_children(timeout: float = 10.0) -> None:
    """Fails if this process still has children after `timeout` seconds of grace."""
    deadline = time.monotonic() + timeout
    while (children := live_children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [f"{c.pid} {c.name()}" for c in children if c.is_running()]
    assert not alive, f"child processes outlived the test: {alive}"


@pytest.fixture
def reaped():
    """Use in tests that start processes: each must be gone when the test ends."""
    yield
    assert_no_children()
