"""Chunked pipeline parallelism: a prompt's chunks in several in-flight micro-batches at once,
never two that sample, and correct under aborts, preemption and prefix caching."""

from collections import deque

import pytest

from pipellm import LLM, SamplingParams
from pipellm.config import EngineConfig
from pipellm.engine.chunk_cost import ChunkCostModel
from pipellm.engine.core import EngineCore
from pipellm.protocol import SchedulerOutput
from tests.checkpoints import make_tiny_checkpoint
from tests.test_scheduler import add, fake_output, make_scheduler, run, two_stage_scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def check_sampling_rule(out: SchedulerOutput, in_flight: deque[SchedulerOutput]) -> None:
    """A request joins a micro-batch only if none of its in-flight chunks samples."""
    sampling = {r.request_id for o in in_flight for r in o.requests if r.sample}
    assert not sampling & {r.request_id for r in out.requests}


def test_a_lone_prompt_fills_every_micro_batch():
    scheduler = make_scheduler(
        num_blocks=512,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        num_stages=4,
        pp_microbatch_tokens=100,
    )
    add(scheduler, "long", prompt_len=1000, max_tokens=3)
    first = [scheduler.schedule() for _ in range(4)]
    assert [o.num_tokens for o in first] == [100] * 4
    assert [o.requests[0].num_computed_tokens for o in first] == [0, 100, 200, 300]
    assert [o.requests[0].is_new for o in first] == [True, False, False, False]
    assert not any(o.num_sampled for o in first)


def test_the_sampling_chunk_goes_last_and_decodes_wait_for_its_token():
    scheduler = make_scheduler(
        num_blocks=128,
        max_num_batched_tokens=2048,
        max_model_len=1024,
        num_stages=4,
        pp_microbatch_tokens=64,
    )
    add(scheduler, "long", prompt_len=300, max_tokens=4)
    history = run(scheduler, depth=4, check=check_sampling_rule)
    chunks = [r for o in history for r in o.requests]
    assert sum(r.num_scheduled_tokens for r in chunks if not r.sample) + 1 <= 300
    assert [r.sample for r in chunks].index(True) == len(chunks) - 4, "3 decodes follow"
    assert [r.num_scheduled_tokens for r in chunks[-3:]] == [1, 1, 1]


def test_balancing_off_still_overlaps_a_prompt_longer_than_the_token_cap():
    scheduler = make_scheduler(
        num_blocks=128, max_num_batched_tokens=64, num_stages=3, pp_balance=False
    )
    add(scheduler, "long", prompt_len=200, max_tokens=2)
    depths = []
    run(
        scheduler,
        depth=3,
        check=lambda out, fl: (check_sampling_rule(out, fl), depths.append(len(fl))),
    )
    assert max(depths) == 2, "three 64-token chunks in flight at once"


def test_mixed_load_with_preemption_and_prefix_caching_finishes_cleanly():
    """Small KV pool, shared prefixes, three micro-batches in flight: requests with chunks in
    flight are never preempted (the scheduler asserts it), all finish, every block returns."""
    scheduler = two_stage_scheduler(
        num_blocks=48, block_size=4, max_num_seqs=6, num_stages=3, pp_microbatch_tokens=16
    )
    requests = [
        add(scheduler, str(i), prompt_len=20 + 13 * (i % 4), max_tokens=9) for i in range(12)
    ]
    shared = requests[0].prompt_token_ids[:16]
    for r in requests[::3]:  # a third of them share a 4-block prefix
        r.prompt_token_ids[:16] = shared
        r.all_token_ids[:16] = shared
    overlapped = set()

    def check(out, in_flight):
        check_sampling_rule(out, in_flight)
        busy = {r.request_id for o in in_flight for r in o.requests}
        overlapped.update(busy & {r.request_id for r in out.requests})

    run(scheduler, depth=3, check=check)
    assert scheduler.num_preemptions > 0 and overlapped
    assert all(r.num_output_tokens == 9 for r in requests)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_prefix_hits > 0


def test_abort_with_chunks_in_flight_frees_blocks_after_the_last_returns():
    scheduler = make_scheduler(
        num_blocks=128, max_num_batched_tokens=2048, num_stages=3, pp_microbatch_tokens=40
    )
    add(scheduler, "a", prompt_len=200, max_tokens=5)
    outs = [scheduler.schedule() for _ in range(3)]
    assert all(o.requests[0].request_id == "a" for o in outs)
    scheduler.stop_request("a", "abort")
    assert scheduler.schedule() is None, "an aborted request schedules nothing more"
    bm = scheduler.block_manager
    for out in outs[:2]:
        scheduler.update_from_output(out, fake_output(out))
        assert bm.num_free_blocks < bm.num_blocks, "a chunk is still writing its blocks"
    scheduler.update_from_output(outs[2], fake_output(outs[2]))
    assert bm.num_free_blocks == bm.num_blocks and not scheduler.has_unfinished()
    add(scheduler, "b", prompt_len=4, max_tokens=1)
    assert scheduler.schedule().freed_request_ids == ["a"]


def test_blocks_are_cacheable_only_once_their_chunk_returns():
    scheduler = make_scheduler(
        num_blocks=128, max_num_batched_tokens=2048, num_stages=2, pp_microbatch_tokens=40
    )
    first = add(scheduler, "a", prompt_len=100, max_tokens=2)
    out = scheduler.schedule()  # 50 tokens: blocks 0-11 full once it returns
    twin = add(scheduler, "b", prompt_len=100, max_tokens=2)
    twin.prompt_token_ids[:], twin.all_token_ids[:] = first.prompt_token_ids, first.all_token_ids
    bm = scheduler.block_manager
    assert bm.find_cached_prefix(twin) == [[]]
    scheduler.update_from_output(out, fake_output(out))
    assert len(bm.find_cached_prefix(twin)[0]) == out.num_tokens // 4


def test_chunk_cost_model_inverts_and_grows_with_the_prefix():
    model = ChunkCostModel(attention_ratio=1e-3)
    assert model.cost(0, 100) == 100 * (1 + 1e-3 * 50.5)
    assert model.cost(1000, 100) > 1.9 * model.cost(0, 100)
    for prefix in (0, 17, 900, 5000):
        for target in (1.5, 40.0, 333.3):
            n = model.tokens_for(prefix, target)
            assert model.cost(prefix, n) <= target < model.cost(prefix, n + 1)
    assert ChunkCostModel(0.0).tokens_for(123, 64.0) == 64


def test_cost_balanced_chunks_shrink_along_a_long_prompt_and_cost_the_same():
    model = ChunkCostModel(attention_ratio=1e-3)
    scheduler = make_scheduler(
        num_blocks=1024,
        max_num_batched_tokens=4096,
        max_model_len=4096,
        num_stages=2,
        pp_microbatch_tokens=128,
        chunk_cost=model,
    )
    add(scheduler, "long", prompt_len=2000, max_tokens=1)
    history = run(scheduler, depth=2, check=check_sampling_rule)
    chunks = [(r.num_computed_tokens, r.num_scheduled_tokens) for o in history for r in o.requests]
    sizes = [n for _, n in chunks]
    assert sum(sizes) == 2000 and sizes[0] == 128
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True) and sizes[-2] < 64
    costs = [model.cost(p, n) for p, n in chunks[:-1]]
    assert max(costs) <= model.cost(0, 128) and min(costs) > 0.9 * model.cost(0, 128)


# ---- the engine over real stages: the same greedy tokens with it on and off ------------------


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """Prompts long enough to be cut into several chunks, two sharing a 40-token prefix."""
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("five"), num_layers=5)
    prompts = [[3 + (i * 11 + j * 7) % 290 for j in range(n)] for i, n in enumerate([150, 37, 90])]
    prompts.append(prompts[0][:40] + [9] * 45)
    with LLM(str(directory), enable_chunked_pipeline=False) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return directory, prompts, expected


# "cost": chunk sizes from the chunk-cost model (uneven, shrinking along a prompt; the tiny
# model's attention is a large share of its cost, so they shrink fast).
@pytest.mark.parametrize(
    "stages, balance, chunked_pipeline, chunk_sizing",
    [
        (1, True, True, "fixed"),
        (2, True, True, "fixed"),
        (2, False, True, "fixed"),
        (3, True, True, "fixed"),
        (3, True, False, "fixed"),
        (2, True, True, "cost"),
    ],
)
def test_same_greedy_tokens_with_the_chunked_pipeline_on_and_off(
    five_layers, reaped, stages, balance, chunked_pipeline, chunk_sizing
):
    directory, prompts, expected = five_layers
    engine_args = dict(
        pipeline_parallel_size=stages,
        pp_balance=balance,
        enable_chunked_pipeline=chunked_pipeline,
        pp_chunk_sizing=chunk_sizing,
        max_num_batched_tokens=24,  # not a multiple of the 16-token block: cuts mid-block
        pp_microbatch_tokens=21,
        max_model_len=256,
        max_num_seqs=4,
    )
    with LLM(str(directory), **engine_args) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        summary = llm.engine.stats().pipeline
        assert len(summary["stage_busy_fraction"]) == stages
        if stages > 1:
            assert summary["max_queue_depth"] == stages


@pytest.mark.parametrize("chunked_pipeline", [True, False])
def test_sim_one_long_prompt_fills_all_eight_stages(tmp_path, chunked_pipeline):
    """The batch-queue statistics show it: with the chunked pipeline one prompt keeps eight
    micro-batches in flight; without it, one."""
    config = EngineConfig(
        model=str(make_tiny_checkpoint(tmp_path / "m", num_layers=8)),
        pipeline_parallel_size=8,
        pp_microbatch_tokens=32,
        distributed_executor_backend="sim",
        enable_chunked_pipeline=chunked_pipeline,
        sim_speedup=50.0,
    )
    core = EngineCore(config)
    try:
        core.add_request("long", [7] * 500, SamplingParams(max_tokens=2, ignore_eos=True))
        while core.has_unfinished_requests():
            core.step()
    finally:
        core.shutdown()
    summary = core.pipeline_stats.summary()
    expected = 8 if chunked_pipeline else 1
    assert summary["max_queue_depth"] == summary["max_micro_batches_per_request"] == expected
