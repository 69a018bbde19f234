"""Fair admission: a short request arriving while a long prompt prefills is admitted in the
next micro-batch, at one and two pipeline stages; long prompts are held to a fair share only
while a short one waits, and to --long-prefill-token-threshold always."""

from collections import deque

import pytest

from pipellm.config import DEFAULT_LONG_PREFILL_TOKENS, EngineConfig
from pipellm.engine.core import EngineCore
from pipellm.executor.sim import VirtualSimExecutor
from pipellm.protocol import SchedulerOutput
from pipellm.sampling_params import SamplingParams
from pipellm.sim.clock import VirtualClock
from tests.test_scheduler import add, fake_output, make_scheduler, two_stage_scheduler


def tokens_of(out: SchedulerOutput) -> dict[str, int]:
    return {item.request_id: item.num_scheduled_tokens for item in out.requests}


def test_a_short_request_joins_the_next_step_of_a_long_prefill():
    scheduler = make_scheduler(num_blocks=128, max_num_batched_tokens=32)
    long = add(scheduler, "long", prompt_len=300, max_tokens=1)
    first = scheduler.schedule()
    assert tokens_of(first) == {"long": 32}  # alone, the long prompt takes the whole budget
    scheduler.update_from_output(first, fake_output(first))
    add(scheduler, "short", prompt_len=5, max_tokens=3)
    second = scheduler.schedule()
    # Half the budget (the fair share) for the long prompt, the short one admitted.
    assert tokens_of(second) == {"long": 16, "short": 5}
    scheduler.update_from_output(second, fake_output(second))
    finished_first = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_output(out))
        finished_first += [r for r in ("short", "long") if r not in scheduler.requests]
    assert finished_first[0] == "short"  # done long before the long prompt's prefill
    assert long.num_output_tokens == 1


def test_a_short_request_is_admitted_into_the_pipeline_of_a_long_prefill():
    """Two stages, the long prompt's chunks filling both: the next micro-batch formed after
    the short request arrives carries it."""
    scheduler = two_stage_scheduler(max_num_batched_tokens=2048)
    add(scheduler, "long", prompt_len=2000, max_tokens=1)
    in_flight = deque([scheduler.schedule(), scheduler.schedule()])
    assert all(set(tokens_of(out)) == {"long"} for out in in_flight)
    add(scheduler, "short", prompt_len=5, max_tokens=3)
    done = in_flight.popleft()
    scheduler.update_from_output(done, fake_output(done))
    nxt = scheduler.schedule()
    assert tokens_of(nxt)["short"] == 5
    assert tokens_of(nxt)["long"] <= scheduler.config.pp_microbatch_tokens // 2


def test_short_requests_pass_a_long_one_waiting_for_a_partial_prefill_slot():
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=32)
    add(scheduler, "long-a", prompt_len=300, max_tokens=1)
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_output(out))
    add(scheduler, "long-b", prompt_len=300, max_tokens=1)
    add(scheduler, "short", prompt_len=5, max_tokens=1)
    assert tokens_of(scheduler.schedule()) == {"long-a": 16, "short": 5}


def test_more_partial_prefills_and_a_set_threshold():
    scheduler = make_scheduler(
        num_blocks=256,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=8,
        max_num_partial_prefills=2,
    )
    add(scheduler, "long-a", prompt_len=300, max_tokens=1)
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_output(out))
    add(scheduler, "long-b", prompt_len=300, max_tokens=1)
    add(scheduler, "short", prompt_len=5, max_tokens=1)
    assert tokens_of(scheduler.schedule()) == {"long-a": 8, "long-b": 8, "short": 5}


def test_the_threshold_caps_every_chunk_even_with_nothing_waiting():
    """vLLM's meaning: a request arriving mid-step then waits for a step of at most this."""
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=32)
    scheduler.config.long_prefill_token_threshold = 12
    add(scheduler, "long", prompt_len=300, max_tokens=1)
    assert tokens_of(scheduler.schedule()) == {"long": 12}


def test_long_prompts_alone_keep_the_whole_budget():
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=32)
    add(scheduler, "long-a", prompt_len=300, max_tokens=1)
    add(scheduler, "long-b", prompt_len=300, max_tokens=1)
    assert tokens_of(scheduler.schedule()) == {"long-a": 32}


# The case: an 8,000-token prompt, then 3 s later a 5-token request.
ARRIVAL_S = 3.0
TTFT_GOAL_S = 2.0


@pytest.mark.parametrize("pp", [1, 2])
def test_a_short_request_behind_an_8000_token_prompt_with_the_defaults(pp):
    """The real engine loop and scheduler, with the built-in model's stages modelled in virtual
    time (the sim backend's roofline of an idle 2-core CPU): with the default settings the short
    request's first token comes within the goal, and the long prompt computes at most two
    capped chunks ahead of it: the step under way when it arrives, and the one it shares.

    With the cap off (the old default) one stage took 2048-token steps: 3,072 tokens ahead and
    3.4 s simulated (86.8 s on a loaded machine, docs/reliability.md)."""
    clock = VirtualClock()
    config = EngineConfig(distributed_executor_backend="sim", pipeline_parallel_size=pp)
    core = EngineCore(config, VirtualSimExecutor(config, clock), clock=clock.time)
    try:
        core.add_request("long", [504] * 8000, SamplingParams(max_tokens=1))
        long = core.scheduler.requests["long"]
        computed_before = 0
        while clock.now < ARRIVAL_S:  # the step that ends past ARRIVAL_S was under way then
            computed_before = long.num_computed_tokens
            core.step()
        assert long.num_computed_tokens < 8000, "the long prompt's prefill ended before"
        core.add_request("short", [504] * 5, SamplingParams(max_tokens=5))
        while not any(out.request_id == "short" for out in core.step()):
            pass
        ttft_s = clock.now - ARRIVAL_S
        ahead = long.num_computed_tokens - computed_before
    finally:
        core.executor.shutdown()
    assert ttft_s <= TTFT_GOAL_S and ahead <= 2 * DEFAULT_LONG_PREFILL_TOKENS, (ttft_s, ahead)


def test_the_cli_help_states_the_configs_default_threshold():
    # The CLI states the default as text, because building its parser must not import torch.
    import argparse

    from pipellm.entrypoints.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    (action,) = [a for a in parser._actions if "--long-prefill-token-threshold" in a.option_strings]
    assert f"default {DEFAULT_LONG_PREFILL_TOKENS} at one stage" in action.help
