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

Every engine process (each pipeline stage too) loads the library, and asking torch's builder
whether it is current costs an import of its build tooling (setuptools and more) and a ninja
run. So after a build pipellm writes a stamp beside the library: a digest of everything the
build read (the sources, the headers beside them, the flags, torch's and Python's versions, the
compiler named by CXX) and the library's own size and modification time. A process whose
digest matches, on a library that has not changed since, loads it directly; any other asks
torch's builder, which rebuilds what changed, and writes the stamp again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Far above a build's time (pipellm's kernels: ~1 min a level on 2 cores, ~5 min under load).
STALE_LOCK_S = 900.0
_POLL_S = 0.5


_STAMP = "pipellm_build_stamp.json"
_HEADER_SUFFIXES = (".h", ".hpp")


def build_directory(name: str) -> Path:
    """The folder torch's builder builds extension `name` in: $TORCH_EXTENSIONS_DIR, else its
    per-user cache folder with a Python-version-and-accelerator subfolder (computed here as
    torch does, so that a current build loads without importing torch's build tooling)."""
    import torch
    from torch import _appdirs  # a submodule that `import torch` alone does not load

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        cache = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
        root = os.path.join(cache, f"{python}_{accelerator}")
    return Path(root) / name


def build_lock(name: str) -> Path:
    """The lock file torch's builder holds while it builds extension `name`."""
    return build_directory(name) / "lock"


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


def load_extension(
    name: str,
    sources: list[str],
    extra_include_paths: list[str] | None = None,
    **kwargs: Any,
) -> str:
    """Loads extension `name` (not a Python module: its ops register with torch.ops) and
    returns its library's path: directly where its stamp says the build is current, else
    through `torch.utils.cpp_extension.load` (which builds what changed), after
    clear_stale_lock(name), with this environment's ninja."""
    import torch

    inputs = _inputs_digest(name, sources, extra_include_paths or [], kwargs)
    stamp = build_directory(name) / _STAMP
    library = _current_library(stamp, inputs)
    if library is not None:
        torch.ops.load_library(library)
        return str(library)
    from torch.utils import cpp_extension

    clear_stale_lock(name)
    with environments_ninja_first():
        path = cpp_extension.load(
            name=name,
            sources=sources,
            extra_include_paths=extra_include_paths,
            is_python_module=False,
            **kwargs,
        )
    _write_stamp(stamp, inputs, Path(path))
    return path


def _inputs_digest(
    name: str, sources: list[str], include_paths: list[str], options: dict[str, Any]
) -> str:
    """A digest of everything a build of `name` reads: changing any of it means a rebuild."""
    import torch

    digest = hashlib.sha256()
    settings = [name, options, include_paths, torch.__version__, sys.version]
    digest.update(json.dumps([*settings, os.environ.get("CXX", "")], default=str).encode())
    headers = {
        header
        for folder in {str(Path(source).parent) for source in sources} | set(include_paths)
        for header in Path(folder).iterdir()
        if header.suffix in _HEADER_SUFFIXES
    }
    for path in [*map(Path, sources), *sorted(headers)]:
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _current_library(stamp: Path, inputs: str) -> Path | None:
    """The library the stamp names, if it was built from `inputs` and has not changed since."""
    try:
        recorded = json.loads(stamp.read_text())
        library = Path(recorded["library"])
        status = library.stat()
    except (OSError, ValueError, KeyError):
        return None
    if recorded.get("inputs") != inputs:
        return None
    if [status.st_size, status.st_mtime_ns] != recorded.get("size_and_mtime_ns"):
        return None  # rebuilt by something that wrote no stamp
    return library


def _write_stamp(stamp: Path, inputs: str, library: Path) -> None:
    status = library.stat()
    record = {
        "inputs": inputs,
        "library": str(library),
        "size_and_mtime_ns": [status.st_size, status.st_mtime_ns],
    }
    partial = stamp.with_name(f"{stamp.name}.{os.getpid()}")
    partial.write_text(json.dumps(record))
    partial.replace(stamp)  # atomic: a reader sees the old stamp or the new one
