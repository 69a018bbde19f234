"""torch's JIT extension builder, without waiting forever on a build that died, and with one
ninja for every process of an install.

`torch.utils.cpp_extension.load` lets one process build an extension at a time: the builder
holds a `lock` file in the extension's build folder, and every other process waits, with no
time limit, until the file is gone. A build killed midway (Ctrl-C during a first engine start,
a timeout) leaves the file behind, and every later start would then hang without a word. So
before handing over to torch, wait for a lock only as long as a build can take, saying what we
wait for, then remove it as stale.

torch runs whichever `ninja` PATH finds first, and ninja versions record a build's commands
differently (1.11 and 1.13 hash them apart): a process whose PATH has the environment's own
bin folder (a Ray worker, an activated venv) and one whose PATH does not would each take the
other's build for stale and rebuild every kernel, ~100 s a time on 2 cores. So the build runs
with the ninja installed beside this interpreter (the `ninja` dependency) first on PATH.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Far above a build's time (pipellm's kernels: ~30 s a level on 2 cores, ~2 min under load).
STALE_LOCK_S = 900.0
_POLL_S = 0.5


def build_lock(name: str) -> Path:
    """The lock file torch's builder holds while it builds extension `name`."""
    from torch.utils import cpp_extension

    # The same folder torch builds in ($TORCH_EXTENSIONS_DIR or its default root).
    return Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"


def clear_stale_lock(name: str, stale_after_s: float = STALE_LOCK_S) -> None:
    """Returns once extension `name` has no build lock: at once if none is there, when another
    process's build ends, or by removing a lock older than `stale_after_s` (its build died)."""
    lock = build_lock(name)
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after_s:
            logger.warning(
                "removing %s: a build of %s started %.0f s ago and never finished (its process "
                "died); building again",
                lock,
                name,
                age,
            )
            lock.unlink(missing_ok=True)
            return
        if not said:
            logger.info("waiting for another process's build of %s (lock file %s)", name, lock)
            said = True
        time.sleep(_POLL_S)


@contextlib.contextmanager
def environments_ninja_first() -> Iterator[None]:
    """PATH starts with this environment's scripts folder while the block runs, if it holds a
    ninja (else PATH is left alone)."""
    scripts = sysconfig.get_path("scripts")
    old = os.environ.get("PATH", "")
    if not (Path(scripts) / "ninja").exists() or old.split(os.pathsep)[0] == scripts:
        yield
        return
    os.environ["PATH"] = os.pathsep.join([scripts, old]) if old else scripts
    try:
        yield
    finally:
        os.environ["PATH"] = old


def load_extension(name: str, **kwargs: Any) -> Any:
    """`torch.utils.cpp_extension.load(name=name, **kwargs)`, after clear_stale_lock(name), with
    this environment's ninja."""
    from torch.utils import cpp_extension

    clear_stale_lock(name)
    with environments_ninja_first():
        return cpp_extension.load(name=name, **kwargs)
