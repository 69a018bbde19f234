"""A build lock left by a killed build must not hang every later start."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from pipellm.kernels import extension_build


@pytest.fixture
def own_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return tmp_path


def test_a_stale_lock_is_removed_and_the_build_runs(own_extensions_dir, caplog):
    source = own_extensions_dir / "tiny.cpp"
    source.write_text('extern "C" int pipellm_tiny() { return 7; }\n')
    lock = extension_build.build_lock("pipellm_test_tiny")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    with caplog.at_level(logging.WARNING):
        extension_build.load_extension("pipellm_test_tiny", sources=[str(source)], verbose=False)
    assert not lock.exists()
    assert "never finished" in caplog.text
    assert (lock.parent / "pipellm_test_tiny.so").exists()


def test_a_live_build_is_waited_for(own_extensions_dir, caplog):
    lock = extension_build.build_lock("pipellm_test_wait")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    # A fresh lock is another process's build: waited for while it lasts, stale after the limit.
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        extension_build.clear_stale_lock("pipellm_test_wait", stale_after_s=1.0)
    assert 0.4 < time.monotonic() - started < 10
    assert "waiting for another process's build" in caplog.text
    assert not lock.exists()
    extension_build.clear_stale_lock("pipellm_test_wait")  # no lock: returns at once


def test_builds_use_the_environments_own_ninja(monkeypatch):
    """Whatever PATH a process has, the build finds the ninja installed beside its Python."""
    scripts = sysconfig.get_path("scripts")
    if not (Path(scripts) / "ninja").exists():
        pytest.skip("no ninja installed in this environment")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with extension_build.environments_ninja_first():
        assert shutil.which("ninja") == str(Path(scripts) / "ninja")
    assert os.environ["PATH"] == "/usr/bin:/bin"


_LOAD_AND_CALL = """
import ctypes, sys
from pipellm.kernels import extension_build
path = extension_build.load_extension("pipellm_test_stamp", sources=[sys.argv[1]], verbose=False)
print(ctypes.CDLL(path).pipellm_tiny(), "torch.utils.cpp_extension" in sys.modules)
"""


def test_a_current_build_loads_directly_and_a_changed_source_rebuilds(own_extensions_dir):
    """Fresh processes (as every engine start): the first builds; the next loads the library
    without torch's build tooling; after a source or header edit, the next rebuilds."""
    source = own_extensions_dir / "tiny.cpp"
    header = own_extensions_dir / "tiny.h"
    header.write_text("#define TINY_OFFSET 0\n")
    source.write_text(
        '#include "tiny.h"\nextern "C" int pipellm_tiny() { return 7 + TINY_OFFSET; }\n'
    )

    def load_and_call() -> tuple[str, str]:
        command = [sys.executable, "-c", _LOAD_AND_CALL, str(source)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
        value, used_builder = done.stdout.split()
        return value, used_builder

    assert load_and_call() == ("7", "True")  # built
    assert load_and_call() == ("7", "False")  # current: loaded directly
    source.write_text(source.read_text().replace("7 +", "8 +"))
    assert load_and_call() == ("8", "True")
    assert load_and_call() == ("8", "False")
    header.write_text("#define TINY_OFFSET 10\n")
    assert load_and_call() == ("18", "True")


def test_the_build_directory_is_torchs(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    theirs = cpp_extension._get_build_directory("pipellm_test_dir", verbose=False)
    assert extension_build.build_directory("pipellm_test_dir") == Path(theirs)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    theirs = cpp_extension._get_build_directory("pipellm_test_dir", verbose=False)
    assert extension_build.build_directory("pipellm_test_dir") == Path(theirs)


def test_the_default_build_directory_in_a_fresh_interpreter(monkeypatch, tmp_path):
    """Without $TORCH_EXTENSIONS_DIR, in a process that has imported nothing of torch's build
    tooling (as every engine start is): the same folder as torch's builder, and the tooling
    still not imported."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    script = (
        "import sys\n"
        "from pipellm.kernels.extension_build import build_directory\n"
        "print(build_directory('pipellm_test_dir'))\n"
        "print('torch.utils.cpp_extension' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    ours, tooling_imported = done.stdout.split()
    theirs = cpp_extension._get_build_directory("pipellm_test_dir", verbose=False)
    assert Path(ours) == Path(theirs)
    assert tooling_imported == "False"
