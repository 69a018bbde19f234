"""Pipeline parallelism: same tokens at any stage count, a full batch queue, clean failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future

import psutil
import pytest

from pipellm import LLM, SamplingParams
from pipellm.config import EngineConfig
from pipellm.engine.core import EngineCore
from pipellm.executor.base import Executor, WorkerDiedError
from pipellm.protocol import ModelOutput, SchedulerOutput
from tests.checkpoints import make_tiny_checkpoint
from tests.conftest import assert_no_children

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("six"), num_layers=6)
    prompts = [[3 + (i * 7 + j) % 290 for j in range(5 + 9 * i)] for i in range(8)]
    with LLM(str(directory)) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    return directory, prompts, expected


@pytest.mark.parametrize(
    "stages, balance, chunked, async_depth, blocking_loop",
    # With chunked prefill on, 2 and 3 stages with and without balancing are
    # test_chunked_pipeline.py's test_same_greedy_tokens_with_the_chunked_pipeline_on_and_off.
    [
        (3, True, False, None, False),
        # Unbalanced, one micro-batch is in flight with either loop: this case runs the
        # blocking one (its other sizes: test_same_tokens_with_the_blocking_loop); unbalanced
        # stages without it: test_chunked_pipeline and test_smollm2's T = 2 x P = 2.
        (2, False, False, None, True),
        (2, True, True, 1, False),  # a spare micro-batch queued at the first stage
    ],
)
def test_same_tokens_at_every_pipeline_size(
    six_layers, reaped, stages, balance, chunked, async_depth, blocking_loop
):
    directory, prompts, expected = six_layers
    engine_args = dict(
        pipeline_parallel_size=stages,
        pp_balance=balance,
        pp_async_batch_depth=async_depth,
        pp_blocking_loop=blocking_loop,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=32 if chunked else 512,
        max_model_len=512,
        max_num_seqs=4,
    )
    with LLM(str(directory), **engine_args) as llm:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        summary = llm.engine.stats().pipeline
        assert len(summary["stage_busy_fraction"]) == stages
        if balance:
            assert summary["max_queue_depth"] >= 2, "micro-batches overlapped"
        if async_depth:
            assert summary["max_queue_depth"] == stages + async_depth
        if blocking_loop:
            assert summary["max_queue_depth"] == 1


class RecordingExecutor(Executor):
    """Answers every micro-batch at once with token 7 and remembers what was in flight."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.core: EngineCore | None = None
        self.depths: list[int] = []
        self.prompt_work: list[bool] = []  # the micro-batch carries prompt tokens
        self.overlaps: list[set[str]] = []  # requests already in an in-flight micro-batch
        self.sampling_overlaps: list[set[str]] = []  # ... in one whose chunk samples

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        in_flight = [r for out, _ in self.core.in_flight for r in out.requests]
        ids = {r.request_id for r in scheduler_output.requests}
        self.overlaps.append({r.request_id for r in in_flight} & ids)
        self.sampling_overlaps.append({r.request_id for r in in_flight if r.sample} & ids)
        self.depths.append(len(self.core.in_flight) + 1)
        self.prompt_work.append(
            any(
                r.num_output_tokens == 0 or r.num_scheduled_tokens > 1
                for r in scheduler_output.requests
            )
        )
        future: Future[ModelOutput] = Future()
        future.set_result(
            ModelOutput(scheduler_output.micro_batch_id, [7] * scheduler_output.num_sampled)
        )
        return future

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def run_with_recorder(
    directory,
    stages: int,
    balance: bool,
    prompt_len: int,
    num: int,
    chunked_pipeline=True,
    async_depth: int | None = None,
    blocking_loop: bool = False,
):
    config = EngineConfig(
        model=str(directory),
        max_num_seqs=8,
        max_num_batched_tokens=32 * prompt_len,
        pp_balance=balance,
        pipeline_parallel_size=stages,
        distributed_executor_backend="mp",
        enable_chunked_pipeline=chunked_pipeline,
        pp_async_batch_depth=async_depth,
        pp_blocking_loop=blocking_loop,
    )
    recorder = RecordingExecutor(stages)
    core = EngineCore(config, executor=recorder)
    recorder.core = core
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    next_id = 0
    # Keep 8 requests open, like a client with max concurrency 8 (vLLM issue #27462's workload).
    while next_id < num or core.has_unfinished_requests():
        while next_id < num and len(core.scheduler.requests) < 8:
            core.add_request(str(next_id), [5] * prompt_len, params)
            next_id += 1
        core.step()
    return recorder


def test_queue_fills_to_the_pipeline_depth_and_requests_never_overlap(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "m")
    recorder = run_with_recorder(
        directory, stages=4, balance=True, prompt_len=40, num=32, chunked_pipeline=False
    )
    assert max(recorder.depths) == 4
    assert not any(recorder.overlaps), "a request was in two in-flight micro-batches"


def test_one_long_prompt_is_in_every_in_flight_micro_batch_never_two_sampling(tmp_path):
    """The chunked pipeline: a lone prompt's chunks fill all four micro-batches in flight, and
    none joins one while its sampling chunk (or a decode) is out."""
    directory = make_tiny_checkpoint(tmp_path / "m")
    recorder = run_with_recorder(directory, stages=4, balance=True, prompt_len=400, num=1)
    assert max(recorder.depths) == 4
    assert max(len(o) for o in recorder.overlaps) == 1
    assert sum(bool(o) for o in recorder.overlaps) >= 3
    assert not any(recorder.sampling_overlaps)
    assert recorder.core.pipeline_stats.summary()["max_micro_batches_per_request"] == 4
    busy = run_with_recorder(directory, stages=4, balance=True, prompt_len=40, num=32)
    assert max(busy.depths) == 4 and not any(busy.sampling_overlaps)


def test_async_batch_depth_queues_spare_micro_batches_that_need_no_in_flight_output(tmp_path):
    """pp_async_batch_depth = 1: prompt chunks fill P + 1 slots, while a request whose next
    step samples (or decodes) still waits for its in-flight micro-batch, and decodes alone
    never take the spare slot."""
    directory = make_tiny_checkpoint(tmp_path / "m")
    recorder = run_with_recorder(
        directory, stages=2, balance=True, prompt_len=400, num=1, async_depth=1
    )
    assert max(recorder.depths) == 3
    assert recorder.core.pipeline_stats.summary()["max_micro_batches_per_request"] == 3
    assert not any(recorder.sampling_overlaps)
    busy = run_with_recorder(
        directory, stages=2, balance=True, prompt_len=40, num=32, async_depth=1
    )
    assert max(busy.depths) == 3 and not any(busy.sampling_overlaps)
    spare = [work for depth, work in zip(busy.depths, busy.prompt_work, strict=True) if depth == 3]
    assert spare and all(spare), "a micro-batch of decodes only took the spare slot"
    assert not all(busy.prompt_work), "decode-only micro-batches were formed (in P slots)"
    plain = run_with_recorder(directory, stages=2, balance=True, prompt_len=400, num=1)
    assert max(plain.depths) == 2, "mp keeps one micro-batch a stage by default"


@pytest.mark.parametrize("balance", [True, False])
def test_blocking_loop_waits_for_each_result_before_scheduling_the_next(tmp_path, balance):
    """vLLM's loop before its PR #28768: one micro-batch in flight, whether balanced or not,
    and for a lone long prompt as for many short ones; without the switch the same workloads
    fill the pipeline."""
    directory = make_tiny_checkpoint(tmp_path / "m")
    for prompt_len, num in [(400, 1), (40, 32)]:
        blocking = run_with_recorder(directory, 4, balance, prompt_len, num, blocking_loop=True)
        assert max(blocking.depths) == 1
        assert blocking.core.max_in_flight == 1
    if balance:
        assert max(run_with_recorder(directory, 4, balance, 400, 1).depths) == 4


def test_without_balancing_the_seed_workload_never_overlaps_micro_batches(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "m")
    recorder = run_with_recorder(directory, stages=4, balance=False, prompt_len=40, num=32)
    assert max(recorder.depths) == 1


@pytest.mark.parametrize("stages, balance", [(1, True), (2, True)])  # (2, False): above
def test_same_tokens_with_the_blocking_loop(six_layers, reaped, stages, balance):
    directory, prompts, expected = six_layers
    engine_args = dict(
        pipeline_parallel_size=stages,
        pp_balance=balance,
        pp_blocking_loop=True,
        max_num_batched_tokens=32,
        max_model_len=512,
        max_num_seqs=4,
    )
    with LLM(str(directory), **engine_args) as llm:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.engine.stats().pipeline["max_queue_depth"] == 1


def test_a_killed_stage_is_a_clear_error_not_a_hang(six_layers, reaped):
    directory, prompts, _ = six_layers
    llm = LLM(str(directory), pipeline_parallel_size=2)
    try:
        victim = llm.engine.executor.processes[1].pid
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="stage 1"):
            llm.generate(prompts * 20, SamplingParams(max_tokens=200), use_tqdm=False)
        assert time.monotonic() - started < 10
        # The engine stays failed: a later call is the same clear error, never a hang.
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match="stage 1"):
            llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - started < 10
    finally:
        llm.shutdown()


def test_a_send_to_a_killed_stage_names_it(six_layers, reaped):
    """The engine's send can find a stage's pipe closed before the reader thread sees the
    process's exit: the error must still name the stage and its signal."""
    directory, _, _ = six_layers
    llm = LLM(str(directory), pipeline_parallel_size=2)
    executor = llm.engine.executor
    try:
        executor._closed = True  # stop the reader, so only submit() can find the death
        executor._reader.join(timeout=5)
        victim = executor.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=5)
        empty = SchedulerOutput(micro_batch_id=0, requests=[])
        future = executor.submit(empty)
        assert future.done(), "a send to a dead stage's pipe should fail at once"
        with pytest.raises(WorkerDiedError, match="stage 1 .*SIGKILL"):
            future.result()
    finally:
        executor._closed = False
        llm.shutdown()


def test_stages_are_reaped_when_the_owner_exits_without_shutdown(six_layers, tmp_path):
    directory, _, _ = six_layers
    script = textwrap.dedent(
        f"""
        import os, sys
        from pipellm import LLM
        llm = LLM({str(directory)!r}, pipeline_parallel_size=2)
        print(",".join(str(p.pid) for p in llm.engine.executor.processes), flush=True)
        raise KeyboardInterrupt
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "KeyboardInterrupt" in result.stderr
    pids = [int(p) for p in result.stdout.strip().splitlines()[-1].split(",")]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in pids)
    assert_no_children()
