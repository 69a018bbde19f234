"""Llama 3 (RoPE scaling as a rope_freqs tensor), Qwen2 and Qwen3 from GGUF files written the
way llama.cpp's converter writes them: greedy tokens equal transformers' on the Hugging Face
checkpoint the file was made from."""

from __future__ import annotations

import json

import pytest

from pipellm.loader.source import load_model_config, resolve_model
from tests.checkpoints import make_tiny_checkpoint, write_tiny_gguf
from tests.test_generate import generate, make_prompts, reference_greedy

LLAMA3_ROPE = {
    "rope_theta": 10000.0,
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_gguf_matches_transformers(tmp_path, arch):
    folder = make_tiny_checkpoint(tmp_path / arch, arch="llama" if arch == "llama3" else arch)
    if arch == "llama3":
        config = json.loads((folder / "config.json").read_text())
        config["rope_parameters"] = LLAMA3_ROPE
        (folder / "config.json").write_text(json.dumps(config))
    path = write_tiny_gguf(folder, tmp_path / f"{arch}.gguf")
    config = load_model_config(resolve_model(str(path)))
    assert config.architecture == load_model_config(resolve_model(str(folder))).architecture
    assert (config.rope_scaling is not None) == (arch == "llama3")
    assert config.qk_norm == (arch == "qwen3") and config.attention_bias == (arch == "qwen2")
    prompts = make_prompts(vocab_size=300)[:3]
    assert generate(path, prompts) == reference_greedy(folder, prompts)
