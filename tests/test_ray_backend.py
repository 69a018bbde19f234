"""The Ray backend: one actor per stage (per rank with tensor parallelism), same tokens as one
process, clean failure and exit."""

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


PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[3 + (i * 5 + j) % 290 for j in range(6 + 7 * i)] for i in range(6)]
PROMPTS.append([5 + j % 200 for j in range(300)])  # chunks of it in flight at once


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """A tiny checkpoint (4 query / 2 KV heads) and one process's greedy tokens on PROMPTS."""
    directory = str(make_tiny_checkpoint(tmp_path_factory.mktemp("ray") / "m", num_layers=6))
    with LLM(directory) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return directory, expected


@pytest.fixture
def marker(monkeypatch):
    """A private Ray for the test; every process of it inherits this marker from the driver,
    and none may be left 10 s after the test."""
    marker = f"pipellm-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("PIPELLM_TEST_MARKER", marker)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield marker
    # No process of pipellm's Ray is left 10 s after shutdown, Ray's agents included.
    deadline = time.monotonic() + 10
    while processes_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_marked(marker) == []


def test_ray_stages_match_and_a_killed_actor_is_a_clear_error(six_layers, reaped, marker):
    directory, expected = six_layers
    llm = LLM(directory, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == expected
        assert len(processes_marked(marker)) >= 4  # the check below sees Ray's processes
        # P = 2 plus the spare micro-batch a Ray pipeline keeps by default (pp_async_batch_depth).
        assert llm.engine.stats().pipeline["max_queue_depth"] == 3
        os.kill(llm.engine.executor.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="stage 1"):
            llm.generate(PROMPTS * 10, SamplingParams(max_tokens=100), use_tqdm=False)
        assert time.monotonic() - started < 10
    finally:
        llm.shutdown()


def test_ray_tensor_parallel_ranks_match_and_a_killed_rank_is_named(six_layers, reaped, marker):
    """TP = 2: two actors of one stage, on this host, so they all-reduce in shared memory."""
    import ray

    directory, expected = six_layers
    llm = LLM(directory, tensor_parallel_size=2, distributed_executor_backend="ray", num_threads=1)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == expected
        executor = llm.engine.executor
        comms = ray.get([actor.tensor_parallel_comm.remote() for actor in executor.actors])
        assert comms == ["ShmComm", "ShmComm"]
        os.kill(executor.pids[1], signal.SIGKILL)  # rank 0 waits on it at its next all-reduce
        with pytest.raises(WorkerDiedError, match="stage 0 \\(tensor-parallel rank 1\\)"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
