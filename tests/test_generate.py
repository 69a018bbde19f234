"""End to end: pipellm's greedy tokens equal transformers' on tiny seeded checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pipellm import LLM, SamplingParams
from tests.checkpoints import make_tiny_checkpoint, one_torch_thread

NUM_NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 17, 40, 64, 9, 33)


def make_prompts(vocab_size: int, shared_prefix: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    prefix = torch.randint(3, vocab_size, (shared_prefix,), generator=generator).tolist()
    return [
        prefix + torch.randint(3, vocab_size, (n,), generator=generator).tolist()
        for n in PROMPT_LENGTHS
    ]


def reference_greedy(
    model_dir, prompts: list[list[int]], num_tokens: int = NUM_NEW_TOKENS
) -> list[list[int]]:
    """Plain full-recompute greedy decoding with transformers, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outputs = []
    with one_torch_thread(), torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(num_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outputs.append(ids[len(prompt) :])
    return outputs


def build_case(arch: str, tmp_path_factory):
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch=arch)
    prompts = make_prompts(vocab_size=300, shared_prefix=20)
    return directory, prompts, reference_greedy(directory, prompts)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    return build_case("llama", tmp_path_factory)


@pytest.fixture(scope="module", params=["llama", "qwen2", "tied", "mistral"])
def checkpoint(request, tmp_path_factory):
    if request.param == "llama":
        return request.getfixturevalue("llama_checkpoint")  # built once for the module
    return build_case(request.param, tmp_path_factory)


def assert_every_block_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "every block is free afterwards"
    assert all(count == 0 for count in bm.ref_counts)
    assert all(bm.num_held_blocks(g) == 0 for g in range(len(bm.pools))), "every group's"


def generate(model_dir, prompts, **engine_args) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_every_block_free(llm)
        return [list(o.outputs[0].token_ids) for o in outputs]


def test_matches_transformers(checkpoint):
    directory, prompts, expected = checkpoint
    assert generate(directory, prompts) == expected


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
        dict(enable_chunked_prefill=False, max_model_len=128, max_num_batched_tokens=128),
        dict(enable_prefix_caching=False),
        dict(max_num_seqs=2),
    ],
    ids=["chunked", "no-chunking", "no-prefix-cache", "few-seqs"],
)
def test_scheduling_choices_do_not_change_tokens(llama_checkpoint, engine_args):
    directory, prompts, expected = llama_checkpoint
    assert generate(directory, prompts, **engine_args) == expected


def test_a_float16_kv_cache_holds_twice_the_blocks_and_keeps_the_tokens(llama_checkpoint):
    """kv_cache_dtype="float16": the same memory holds twice the blocks; a prompt gives the same
    tokens whole or in 16-token chunks that read the earlier ones back from the cache (the
    step's own keys and values are the rounded ones it caches); and the tokens stay near
    transformers' float32 ones (this tiny random model has near-ties that rounding may flip)."""
    directory, prompts, expected = llama_checkpoint
    blocks = {}
    for dtype in ("float32", "float16"):
        with LLM(str(directory), kv_cache_memory=1 << 22, kv_cache_dtype=dtype) as llm:
            blocks[dtype] = llm.engine.block_manager.num_blocks
    assert blocks["float16"] == 2 * blocks["float32"]
    whole = generate(directory, prompts, kv_cache_dtype="float16")
    chunked = generate(
        directory,
        prompts,
        kv_cache_dtype="float16",
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    assert chunked == whole
    pairs = zip(sum(whole, []), sum(expected, []), strict=True)
    same = sum(a == b for a, b in pairs)
    assert same >= 0.9 * len(prompts) * NUM_NEW_TOKENS


def test_prefix_cache_hits_and_preemption_do_not_change_tokens(llama_checkpoint):
    """The first prompt alone, then the other five, which share its 20-token prefix: the next
    one reuses its first block, and 12 blocks of 16 tokens cannot hold five growing sequences, so
    some are preempted and recomputed; the tokens still equal transformers'."""
    directory, prompts, expected = llama_checkpoint
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(directory), kv_cache_memory=12 * 16 * 2 * 4 * 2 * 16 * 4, max_model_len=128
    ) as llm:
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        assert first[0].num_cached_tokens == 0
        assert rest[0].num_cached_tokens >= 16
        assert llm.engine.scheduler.num_preemptions > 0
        assert_every_block_free(llm)
    assert [list(o.outputs[0].token_ids) for o in first + rest] == expected


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.7,
            "mscale_all_dim": 0.5,
            "original_max_position_embeddings": 48,
        },
    ],
    ids=["linear", "llama3", "yarn", "yarn-mscale"],
)
def test_rope_scaling_matches_transformers(tmp_path, rope):
    directory = make_tiny_checkpoint(tmp_path / "m")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    config_path.write_text(json.dumps(config))
    prompts = make_prompts(vocab_size=300)[:3]
    assert generate(directory, prompts) == reference_greedy(directory, prompts)
