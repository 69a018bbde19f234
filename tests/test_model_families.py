"""Qwen3 and Gemma 3 from Hugging Face folders: greedy tokens equal transformers' on tiny
seeded checkpoints, under every scheduling choice, pipeline and tensor parallelism. Gemma 3's
tiny checkpoint has five sliding-window layers of TINY_SLIDING_WINDOW positions then a global
one, and every prompt is longer than the window."""

from __future__ import annotations

import json

import pytest

from pipellm import LLM, SamplingParams
from pipellm.kernels.cpu_kernels import cpu_kernels_available
from pipellm.loader.source import load_model_config, resolve_model
from tests.checkpoints import TINY_SLIDING_WINDOW, make_tiny_checkpoint
from tests.test_generate import (
    NUM_NEW_TOKENS,
    assert_every_block_free,
    build_case,
    generate,
    make_prompts,
    reference_greedy,
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_case("gemma3", tmp_path_factory)


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def family(request, tmp_path_factory):
    if request.param == "gemma3":
        return request.getfixturevalue("gemma3")  # built once for the module
    return build_case(request.param, tmp_path_factory)


def test_matches_transformers_and_prefix_cache_hits_past_the_window(family, reaped):
    """The first prompt alone, then the other five, which share its 20-token prefix (more than
    two of Gemma 3's windows): the next one reuses the prefix's first block, and every
    sequence equals transformers'."""
    directory, prompts, expected = family
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    with LLM(str(directory)) as llm:
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        assert_every_block_free(llm)
    assert first[0].num_cached_tokens == 0 and rest[0].num_cached_tokens >= 16
    assert [list(o.outputs[0].token_ids) for o in first + rest] == expected


def test_gemma3_config_has_its_switches(gemma3):
    config = load_model_config(resolve_model(str(gemma3[0])))
    assert config.sliding_window == TINY_SLIDING_WINDOW
    assert config.sliding_window_layers == (0, 1, 2, 3, 4)
    assert (config.rope_local_theta, config.rope_theta) == (10000.0, 1000000.0)
    assert config.attention_scale == 24**-0.5 and config.head_dim == 32
    assert config.qk_norm and config.sandwich_norms and config.tie_word_embeddings
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert min(len(p) for p in gemma3[1]) > TINY_SLIDING_WINDOW


# Blocks of 16 tokens, K and V, 6 layers, 2 KV heads of 32 float32 values: 12 blocks cannot
# hold six growing sequences, so some are preempted and recomputed.
_PREEMPTING = dict(kv_cache_memory=12 * 16 * 2 * 6 * 2 * 32 * 4, max_model_len=128)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
        dict(enable_chunked_prefill=False, max_model_len=128, max_num_batched_tokens=128),
        dict(enable_prefix_caching=False),
        _PREEMPTING,
        dict(pipeline_parallel_size=2),
    ],
    ids=["chunked", "no-chunking", "no-prefix-cache", "preemption", "pp2"],
)
def test_gemma3_scheduling_choices_do_not_change_tokens(gemma3, engine_args, reaped):
    directory, prompts, expected = gemma3
    assert generate(directory, prompts, **engine_args) == expected


def test_gemma3_long_generation_fits_because_the_window_gives_blocks_back(gemma3):
    """A budget of 6 blocks of all layers: split, the global layer gets 16 (one 256-token
    sequence) and the five local ones 3 usable each, so 23 + 105 tokens (8 blocks, more than
    the 6 a cache without windows would hold) fit only because the local layers give back the
    blocks their 8-token window left."""
    directory = gemma3[0]
    prompt = make_prompts(vocab_size=300, shared_prefix=20)[0]  # 23 tokens
    kv_bytes_per_block = 16 * 2 * 6 * 2 * 32 * 4
    params = SamplingParams(temperature=0, max_tokens=105, ignore_eos=True)
    args = dict(max_model_len=256, enable_chunked_prefill=True, max_num_batched_tokens=16)
    with LLM(str(directory), kv_cache_memory=6 * kv_bytes_per_block, **args) as llm:
        full, window = llm.engine.block_manager.groups
        assert (full.num_blocks, window.window, window.num_blocks - 1) == (16, 8, 3)
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.block_manager.usage == 0
    assert list(output.outputs[0].token_ids) == reference_greedy(directory, [prompt], 105)[0]


def test_mistral_sliding_window_on_every_layer(tmp_path):
    """Mistral's `sliding_window` applies to all its layers (no layer_types in its config).
    Its greedy tokens, on prompts longer than the window, equal transformers' in
    tests/test_generate.py (test_matches_transformers[mistral], the same tiny checkpoint)."""
    directory = make_tiny_checkpoint(tmp_path / "mistral", arch="mistral")
    assert json.loads((directory / "config.json").read_text())["sliding_window"] == (
        TINY_SLIDING_WINDOW
    )
    model_config = load_model_config(resolve_model(str(directory)))
    assert model_config.sliding_window == TINY_SLIDING_WINDOW
    assert model_config.sliding_window_layers == tuple(range(4))
    assert min(len(p) for p in make_prompts(vocab_size=300, shared_prefix=20)) > (
        TINY_SLIDING_WINDOW
    )


def test_tensor_parallel_tokens(family, reaped):
    directory, prompts, expected = family
    assert generate(directory, prompts[:3], tensor_parallel_size=2) == expected[:3]


@pytest.mark.skipif(not cpu_kernels_available(), reason="compares with pipellm's CPU kernels")
def test_gemma3_without_the_cpu_kernels(gemma3, monkeypatch):
    """The PyTorch attention paths (SDPA with window masks) give the kernels' tokens."""
    from pipellm.model import attention

    monkeypatch.setattr(attention, "kernels_apply", lambda x: False)
    directory, prompts, expected = gemma3
    assert generate(directory, prompts, enable_chunked_prefill=True, max_num_batched_tokens=16) == (
        expected
    )
