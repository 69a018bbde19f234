"""`python -O` drops assert statements, so pipellm must never do its work inside one (an
allocation in an assert once vanished that way). The scheduler, the block manager and whole
engine runs (prefix caching and preemption, the chunked pipeline) are run again here in an
interpreter started with -O; the full suite passes that way too (docs/architecture.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_TESTS = [
    "tests/test_block_manager.py",
    "tests/test_scheduler.py",
    "tests/test_chunked_pipeline.py::test_mixed_load_with_preemption_and_prefix_caching_finishes_cleanly",
    "tests/test_chunked_pipeline.py::test_abort_with_chunks_in_flight_frees_blocks_after_the_last_returns",
    "tests/test_generate.py::test_prefix_cache_hits_and_preemption_do_not_change_tokens",
]


def run_optimized(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-O", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_interpreter_really_skips_asserts():
    assert run_optimized("-c", "assert False").returncode == 0


def test_the_engine_core_tests_pass_without_asserts():
    result = run_optimized("-m", "pytest", "-q", "-p", "no:cacheprovider", *CORE_TESTS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
