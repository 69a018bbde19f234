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


def _kernel_levels() -> list[str]:
    from pipellm.kernels.cpu_kernels import supported_levels, why_unavailable

    return supported_levels() if why_unavailable() is None else []


@pytest.fixture(params=_kernel_levels() or [None], ids=lambda level: level or "no-kernels")
def kernel_level(request) -> str:
    """Each instruction-set level of pipellm's CPU kernels this machine runs (one test per
    level); skips where the kernels cannot be built."""
    from pipellm.kernels.cpu_kernels import why_unavailable

    if request.param is None:
        pytest.skip(f"CPU kernels unavailable here: {why_unavailable()}")
    return request.param


@pytest.fixture
def kernel_ops(kernel_level):
    """The kernels' ops (torch.ops.pipellm_<level>) at each level this machine runs."""
    from pipellm.kernels.cpu_kernels import ops

    return ops(kernel_level)
