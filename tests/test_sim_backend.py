"""The sim backend: real scheduling over modelled stages, fast enough for 8 stages in a test."""

import pytest

from pipellm.config import EngineConfig
from pipellm.engine.core import EngineCore
from pipellm.executor.sim import STEP_OVERHEAD_S, cpu_profile
from pipellm.protocol import ScheduledRequest, SchedulerOutput
from pipellm.sampling_params import SamplingParams
from pipellm.sim.shapes import BatchShape
from tests.checkpoints import make_tiny_checkpoint


def run_seed_workload(model: str, balance: bool) -> EngineCore:
    config = EngineConfig(
        model=model,
        pipeline_parallel_size=8,
        distributed_executor_backend="sim",
        max_num_seqs=8,
        max_num_batched_tokens=8 * 400,
        max_model_len=512,
        pp_balance=balance,
        sim_speedup=50.0,
    )
    core = EngineCore(config)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    submitted, open_requests = 0, set()
    while submitted < 24 or open_requests:
        while submitted < 24 and len(open_requests) < 8:
            core.add_request(str(submitted), [7] * 400, params)
            open_requests.add(str(submitted))
            submitted += 1
        for out in core.step():
            if out.finished:
                open_requests.discard(out.request_id)
    core.shutdown()
    return core


def test_seed_scenario_before_and_after(tmp_path):
    model = str(make_tiny_checkpoint(tmp_path / "m", num_layers=8))
    before = run_seed_workload(model, balance=False).pipeline_stats.summary()
    after = run_seed_workload(model, balance=True).pipeline_stats.summary()
    assert before["max_queue_depth"] == 1, (
        "unbalanced (vLLM before #27462): one micro-batch at a time"
    )
    assert after["max_queue_depth"] == 8, "balanced: every stage has its own micro-batch"
    assert len(after["stage_busy_fraction"]) == 8


def decode_batch(n: int) -> SchedulerOutput:
    return SchedulerOutput(
        0, [ScheduledRequest(str(i), 100, 1, [1], [], sample=True) for i in range(n)]
    )


def prefill_batch(tokens: int) -> SchedulerOutput:
    return SchedulerOutput(0, [ScheduledRequest("p", 0, tokens, [1] * tokens, [], sample=True)])


def test_cost_model_is_a_roofline(tmp_path):
    model = str(make_tiny_checkpoint(tmp_path / "m", num_layers=8))
    config = EngineConfig(model=model, pipeline_parallel_size=2, distributed_executor_backend="sim")
    first, last = cpu_profile(config).stage_costs(config.model_config.hf_config_kwargs(), 2)
    assert len(first.layers) == len(last.layers) == 4

    def seconds(cost, batch: SchedulerOutput) -> float:
        return cost.seconds(BatchShape.of(batch))

    # Small decode batches stream the weights once: memory-bound, batch size barely matters.
    assert seconds(first, decode_batch(4)) < 1.1 * seconds(first, decode_batch(1))
    # The last stage also streams the lm_head.
    assert seconds(last, decode_batch(1)) > seconds(first, decode_batch(1))
    # Long prefills are compute-bound: twice the tokens, more than twice the work (attention).
    small, large = seconds(first, prefill_batch(4000)), seconds(first, prefill_batch(8000))
    assert large - STEP_OVERHEAD_S > 2 * (small - STEP_OVERHEAD_S)


def test_a_shared_machine_without_slowdown_is_a_chain_of_fifo_servers():
    """_SharedMachine's events with every factor 1 give each step the start and end of FIFO
    stages (start = max(arrival, stage free), end = start + duration), which the
    independent-stages path computes directly; with factor 2, overlapping steps stretch."""
    import random

    from pipellm.executor.sim import _SharedMachine

    rng = random.Random(0)
    submissions = []
    now = 0.0
    for _ in range(40):
        now += rng.choice([0.0, 0.0, rng.uniform(0, 0.3)])
        submissions.append((now, [rng.uniform(0.01, 0.2) for _ in range(3)], 0.01))
    machine = _SharedMachine(3, lambda busy: 1.0)
    passages = [machine.submit(durations, link, at) for at, durations, link in submissions]
    machine.run_until_done(passages[-1])
    free = [0.0] * 3
    for passage, (at, durations, link) in zip(passages, submissions, strict=True):
        arrival = at
        for stage, (start, end) in enumerate(passage.stage_times):
            expected_start = max(arrival, free[stage])
            assert (start, end) == pytest.approx(
                (expected_start, expected_start + durations[stage])
            )
            free[stage], arrival = end, end + link
    # Two stages of equal work started together, each slowed 2x while both compute.
    machine = _SharedMachine(2, lambda busy: 2.0 if busy > 1 else 1.0)
    first = machine.submit([0.1, 0.1], 0.0, 0.0)
    second = machine.submit([0.1, 0.1], 0.0, 0.0)
    machine.run_until_done(second)
    assert sum(first.stage_times, ()) == pytest.approx((0.0, 0.1, 0.1, 0.3))
    assert sum(second.stage_times, ()) == pytest.approx((0.1, 0.3, 0.3, 0.4))
