"""Tensor parallelism: the same greedy tokens on any TP x PP grid, each rank 1/T of the weights,
clear refusals before any process starts, and a shared-memory all-reduce that leaks nothing."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.config import ConfigError, EngineConfig
from pipellm.executor.base import WorkerDiedError
from pipellm.executor.tp_driver import TensorParallelDriverExecutor
from pipellm.loader.weights import iter_quantized_weights, iter_weights
from pipellm.model.decode_fast_path import FAST_PATH_ENV, why_not_fused
from pipellm.model.llama import LlamaStage
from pipellm.model.stage_spec import StageSpec
from pipellm.model.tp_plan import TensorParallelError, plan_tensor_parallel
from tests.checkpoints import make_tiny_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[3 + (i * 7 + j) % 290 for j in range(5 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """Qwen2-shaped (q/k/v biases, split with their heads) with one KV head: with T = 2 both
    ranks hold it and its bias, each with 2 of the 4 query heads. The split where each
    rank holds its own KV heads runs in test_smollm2 (3 KV heads: 2 + 2, one shared) and
    test_ray_backend (2 KV heads: 1 + 1)."""
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("kv1"), arch="qwen2", num_kv_heads=1)
    with LLM(str(directory)) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return directory, expected


def _tokens(directory, tp: int, pp: int, **kwargs) -> list[list[int]]:
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, num_threads=1, **kwargs)
    with LLM(str(directory), tensor_parallel_size=tp, pipeline_parallel_size=pp, **args) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_same_tokens_on_every_grid(one_kv_head, reaped, tp, pp):
    """T = 2, P = 1 is the next test's engine (the same settings)."""
    directory, expected = one_kv_head
    assert _tokens(directory, tp, pp) == expected


def test_greedy_tokens_without_the_logits_sampling_with_them_and_a_killed_rank(one_kv_head, reaped):
    """Plain greedy rows take each rank's slice maximum (LlamaStage.greedy_tokens); a batch
    with logprobs or a logit bias gathers the logits and samples: the same tokens and
    logprobs as one process, either way. T = 2, P = 1 on mp: rank 0 computes in the engine's
    process, rank 1 in its own; the segment's name is gone once both mapped it; then killing
    rank 1 names it instead of hanging rank 0 at an all-reduce (one engine for all of it: the
    suite's time)."""
    directory, expected = one_kv_head
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={7: 5.0})
    with_logprobs = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    mixed = [PARAMS, biased, with_logprobs, PARAMS]
    # The grid's settings (_tokens): T = 2, P = 1 is checked here.
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, num_threads=1)

    def run(llm: LLM) -> tuple[list, list]:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        out = [o.outputs[0] for o in llm.generate(PROMPTS, mixed, use_tqdm=False)]
        return plain, [(o.token_ids, o.logprobs) for o in out]

    with LLM(str(directory), tensor_parallel_size=1, **args) as llm:
        plain_1, mixed_1 = run(llm)
    llm = LLM(str(directory), tensor_parallel_size=2, **args)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, TensorParallelDriverExecutor)
        assert len(executor.processes) == 1
        assert not list(Path("/dev/shm").glob(f"pipellm-tp-{os.getpid()}-*"))
        plain_2, mixed_2 = run(llm)
        assert plain_2 == plain_1 == expected
        assert [tokens for tokens, _ in mixed_2] == [tokens for tokens, _ in mixed_1]
        logprobs_1, logprobs_2 = mixed_1[2][1], mixed_2[2][1]
        assert logprobs_2 is not None and len(logprobs_2) == len(logprobs_1) == 8
        for (sampled_1, top_1), (sampled_2, top_2) in zip(logprobs_1, logprobs_2, strict=True):
            assert abs(sampled_1 - sampled_2) < 1e-4
            assert [t for t, _ in top_1] == [t for t, _ in top_2]
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top_1, top_2, strict=True))
        os.kill(executor.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        gone = r"tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL"
        with pytest.raises(WorkerDiedError, match=gone):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert time.monotonic() - started < 10
        with pytest.raises(WorkerDiedError, match=gone):  # and stays so
            executor.check_health()
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=gone):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert time.monotonic() - started < 10
    finally:
        llm.shutdown()


def test_fused_decode_path_with_uneven_query_groups(tmp_path, reaped, monkeypatch):
    """6 query / 3 KV heads over 2 ranks: 3 query heads each, in runs of 2 + 1 and 1 + 2 per
    KV head, k/v computed by rows (KV head 1 cut in half) and all-gathered (model/tp_plan.py).
    Both ranks decode on the fused path (kernels/decode_layers.cpp: the shared-memory
    all-reduce and all-gather called from C++) and give the Python path's greedy tokens, which
    are one process's."""
    directory = make_tiny_checkpoint(
        tmp_path, arch="llama", num_layers=2, num_heads=6, num_kv_heads=3
    )
    mc = EngineConfig(str(directory)).model_config
    plans = [plan_tensor_parallel(mc, 2, r) for r in (0, 1)]
    assert [p.kv_group_starts for p in plans] == [(0, 2, 3), (0, 1, 3)]
    assert [p.kv_rows for p in plans] == [(0, 24), (24, 48)] and plans[0].exchanges_qkv
    with LLM(str(directory), max_num_seqs=4) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    tokens = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setenv(FAST_PATH_ENV, "0")  # the ranks' processes inherit it
        with LLM(str(directory), tensor_parallel_size=2, num_threads=1, max_num_seqs=4) as llm:
            model = llm.engine.executor.worker.model  # rank 0, in the engine's process
            assert (model.decode_fast_path is not None) == fused, why_not_fused(model)
            outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            tokens[fused] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[True] == tokens[False] == expected


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _loaded_stage(config: EngineConfig, tp_size: int, rank: int) -> LlamaStage:
    mc = config.model_config
    plan = plan_tensor_parallel(mc, tp_size, rank)
    stage = StageSpec(0, 1, 0, mc.num_hidden_layers)
    model = LlamaStage(mc, stage, torch.float32, plan)
    weights = iter_weights(config.source, mc, stage, torch.float32, (), plan.weight_shard)
    model.load_weights(weights)
    return model


def test_each_rank_loads_its_share_of_the_weights(tmp_path):
    directory = make_tiny_checkpoint(tmp_path, arch="qwen2", num_layers=2)
    config = EngineConfig(str(directory), tensor_parallel_size=2, num_threads=1)
    whole = _loaded_stage(config, 1, 0)
    ranks = [_loaded_stage(config, 2, r) for r in range(2)]
    norms = sum(p.numel() * 4 for n, p in whole.named_parameters() if "norm" in n)
    for model in ranks:  # everything but the norms is split in two
        assert _param_bytes(model) - norms == (_param_bytes(whole) - norms) // 2
    # Rank 1 holds the second half of the query rows, KV head 1, the second half of the MLP
    # columns and of the vocabulary, and o_proj's / down_proj's matching input columns.
    full, part = whole.layers[1], ranks[1].layers[1]
    qkv_full = full.self_attn.qkv_proj.weight.split([64, 32, 32])
    qkv_part = part.self_attn.qkv_proj.weight.split([32, 16, 16])
    for a, b in zip(qkv_full, qkv_part, strict=True):
        assert torch.equal(a[a.shape[0] // 2 :], b)
    assert torch.equal(full.self_attn.o_proj.weight[:, 32:], part.self_attn.o_proj.weight)
    assert torch.equal(full.mlp.down_proj.weight[:, 64:], part.mlp.down_proj.weight)
    assert torch.equal(whole.embed_tokens.weight[150:], ranks[1].embed_tokens.weight)
    assert part.self_attn.o_proj.bias is None  # added once, by rank 0


def test_gguf_ranks_take_whole_blocks():
    """SmolLM2's Q4_1 blocks: a rank's rows are the file's rows; its down_proj columns are
    whole 32-value blocks, the same bytes as the matching part of the whole rows."""
    config = EngineConfig(tensor_parallel_size=2, num_threads=1)
    mc = config.model_config

    def layer0(shard_of=lambda name: None):
        # Layer 0 alone, as a middle stage (1 of 3) would hold it: no embedding, no lm_head.
        stage = StageSpec(1, 3, 0, 1)
        return dict(iter_quantized_weights(config.source, mc, stage, shard_of))

    whole = layer0()
    # q rows 288-575 and k/v rows 96-191 (each cuts a head: the file permutes q/k rows
    # within a head, so the loader unpermutes whole heads, then cuts); MLP 768-1535.
    plan = plan_tensor_parallel(mc, 2, 1)
    part = layer0(plan.weight_shard)
    for name in ("mlp.down_proj", "self_attn.o_proj"):  # input columns: whole blocks
        weight = f"model.layers.0.{name}.weight"
        bytes_per_row = whole[weight].blocks.shape[1]
        assert torch.equal(part[weight].blocks, whole[weight].blocks[:, bytes_per_row // 2 :])
    for name, first_row in (("q_proj", 288), ("k_proj", 96), ("v_proj", 96)):
        weight = f"model.layers.0.self_attn.{name}.weight"
        assert torch.equal(part[weight].blocks, whole[weight].blocks[first_row:])
    # Every matrix of the layer is split exactly in half: no rank streams more than its share.
    assert part.keys() == whole.keys()
    for name, weight in whole.items():
        assert part[name].blocks.numel() * 2 == weight.blocks.numel(), name


def test_straddling_heads_split_the_weights_evenly_and_gather_their_rows():
    """SmolLM2's 9 query / 3 KV heads over 2 ranks: every projection split in half by rows or
    columns; query head 4 (cut by o_proj's split) and KV head 1 attended on both ranks, their
    rows all-gathered; the uneven runs the attention kernels take. Over 3 ranks heads and KV
    groups divide: plain GQA, no gather."""
    mc = EngineConfig(tensor_parallel_size=2, num_threads=1).model_config
    ranks = [plan_tensor_parallel(mc, 2, r) for r in range(2)]
    assert [(p.q_rows, p.kv_rows, p.o_columns) for p in ranks] == [
        ((0, 288), (0, 96), (0, 288)),
        ((288, 576), (96, 192), (288, 576)),
    ]
    assert [(p.q_heads, p.kv_heads, p.o_offset) for p in ranks] == [
        ((0, 5), (0, 2), 0),
        ((4, 9), (1, 3), 32),
    ]
    assert [p.kv_group_starts for p in ranks] == [(0, 3, 5), (0, 2, 5)]
    assert all(p.exchanges_qkv and p.qkv_width == 480 for p in ranks)
    index = ranks[1].qkv_gather_index(ranks)
    # Rank 1's q rows 256-575 (heads 4-8): 256-287 from rank 0's part, the rest its own (at
    # 480); then k rows 64-191 (KV heads 1-2): 64-95 from rank 0 (its k rows start at 288).
    assert index[:33] == list(range(256, 288)) + [480]
    assert index[320:353] == list(range(288 + 64, 288 + 96)) + [480 + 288]
    three = [plan_tensor_parallel(mc, 3, r) for r in range(3)]
    assert [(p.q_heads, p.kv_heads, p.kv_group_starts, p.exchanges_qkv) for p in three] == [
        ((0, 3), (0, 1), None, False),
        ((3, 6), (1, 2), None, False),
        ((6, 9), (2, 3), None, False),
    ]


def test_wrong_settings_fail_before_any_process_starts(tmp_path, monkeypatch):
    directory = make_tiny_checkpoint(tmp_path)  # 4 query / 2 KV heads, MLP 128, vocab 300
    with pytest.raises(ConfigError, match="tensor_parallel_size=8 cannot split 4 query heads"):
        EngineConfig(str(directory), tensor_parallel_size=8, num_threads=1)
    mc = EngineConfig(str(directory)).model_config
    with pytest.raises(TensorParallelError, match="intermediate_size 129 is not divisible"):
        plan_tensor_parallel(dataclasses.replace(mc, intermediate_size=129), 2, 0)
    with pytest.raises(TensorParallelError, match="vocabulary \\(301 tokens\\)"):
        plan_tensor_parallel(dataclasses.replace(mc, vocab_size=301), 2, 0)
    with pytest.raises(ConfigError, match="distributed_executor_backend='uni'.*use mp"):
        EngineConfig(str(directory), tensor_parallel_size=2, distributed_executor_backend="uni")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.raises(ConfigError, match="4 processes, more than the 2 cores.*--num-threads"):
        EngineConfig(str(directory), tensor_parallel_size=2, pipeline_parallel_size=2)
    EngineConfig(str(directory), tensor_parallel_size=2, pipeline_parallel_size=2, num_threads=1)
