"""The Ray backend: one actor per stage, same tokens as one process, clean failure and exit."""

import os
import signal
import time

import pytest

from pipellm import LLM, SamplingParams
from pipellm.executor.base import WorkerDiedError
from tests.checkpoints import make_tiny_checkpoint

pytest.importorskip("ray")


def test_ray_stages_match_and_a_killed_actor_is_a_clear_error(tmp_path, reaped):
    directory = str(make_tiny_checkpoint(tmp_path / "m", num_layers=6))
    prompts = [[3 + (i * 5 + j) % 290 for j in range(6 + 7 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(directory) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(directory, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        assert llm.engine.stats().pipeline["max_queue_depth"] == 2
        os.kill(llm.engine.executor.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="stage 1"):
            llm.generate(prompts * 10, SamplingParams(max_tokens=100), use_tqdm=False)
        assert time.monotonic() - started < 10
    finally:
        llm.shutdown()
