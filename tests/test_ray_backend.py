"""The Ray backend: one actor per stage, same tokens as one process, clean failure and exit."""

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from pipellm import LLM, SamplingParams
from pipellm.executor.base import WorkerDiedError
from tests.checkpoints import make_tiny_checkpoint

pytest.importorskip("ray")


def processes_marked(marker: str) -> list[str]:
    """Processes whose environment holds `marker`: those a run started, however reparented."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:80]!r}")
        except OSError:
            continue
    return found


def test_ray_stages_match_and_a_killed_actor_is_a_clear_error(tmp_path, reaped, monkeypatch):
    # Every process of the private Ray inherits this from the driver.
    marker = f"pipellm-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("PIPELLM_TEST_MARKER", marker)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    directory = str(make_tiny_checkpoint(tmp_path / "m", num_layers=6))
    prompts = [[3 + (i * 5 + j) % 290 for j in range(6 + 7 * i)] for i in range(6)]
    prompts.append([5 + j % 200 for j in range(300)])  # chunks of it in flight at once
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(directory) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(directory, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert len(processes_marked(marker)) >= 4  # the check below sees Ray's processes
        assert llm.engine.stats().pipeline["max_queue_depth"] == 2
        os.kill(llm.engine.executor.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="stage 1"):
            llm.generate(prompts * 10, SamplingParams(max_tokens=100), use_tqdm=False)
        assert time.monotonic() - started < 10
    finally:
        llm.shutdown()
    # No process of pipellm's Ray is left 10 s after shutdown, Ray's agents included.
    deadline = time.monotonic() + 10
    while processes_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_marked(marker) == []
