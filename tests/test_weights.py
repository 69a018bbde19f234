"""iter_weights yields exactly a stage's tensors, equal to the checkpoint's (safetensors, GGUF)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from pipellm.loader.source import load_model_config, resolve_model
from pipellm.loader.weights import iter_weights
from pipellm.model.model_config import ModelConfig
from pipellm.model.stage_spec import StageSpec
from pipellm.text.tokenizer import load_tokenizer
from tests.checkpoints import make_tiny_checkpoint

_LAYER_PARTS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
_QKV_BIASES = ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]


def _expected_names(config: ModelConfig, stage: StageSpec) -> set[str]:
    parts = _LAYER_PARTS + (_QKV_BIASES if config.attention_bias else [])
    layers = range(stage.layer_start, stage.layer_end)
    names = {f"model.layers.{i}.{part}" for i in layers for part in parts}
    if stage.is_first or (stage.is_last and config.tie_word_embeddings):
        names.add("model.embed_tokens.weight")
    if stage.is_last:
        names.add("model.norm.weight")
        if not config.tie_word_embeddings:
            names.add("lm_head.weight")
    return names


def _saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


# Splits of 4 layers into pipeline stages: whole, first of two, last of two, middle of three.
_STAGES = [
    StageSpec(0, 1, 0, 4),
    StageSpec(0, 2, 0, 2),
    StageSpec(1, 2, 2, 4),
    StageSpec(1, 3, 1, 3),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "tied"])
def test_stage_weights_match_the_checkpoint(tmp_path: Path, arch: str) -> None:
    folder = make_tiny_checkpoint(tmp_path, arch)
    source = resolve_model(str(folder))
    config = load_model_config(source)
    saved = _saved_tensors(folder)
    for stage in _STAGES:
        weights = dict(iter_weights(source, config, stage, dtype=torch.float32))
        assert set(weights) == _expected_names(config, stage)
        for name, tensor in weights.items():
            assert torch.equal(tensor, saved[name]), name


def test_sharded_checkpoint_and_dtype(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "qwen2", max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    source = resolve_model(str(folder))
    config = load_model_config(source)
    saved = _saved_tensors(folder)
    weights = dict(iter_weights(source, config, StageSpec(1, 2, 1, 3), dtype=torch.bfloat16))
    assert set(weights) == _expected_names(config, StageSpec(1, 2, 1, 3))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, saved[name].to(torch.bfloat16)), name


def test_weights_equal_the_transformers_state_dict(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "tied")
    source = resolve_model(str(folder))
    config = load_model_config(source)
    state_dict = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for name, tensor in iter_weights(source, config, StageSpec(0, 1, 0, 4), torch.float32):
        assert torch.equal(tensor, state_dict[name]), name
    assert torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"])


def test_bad_layer_range_and_missing_tensor(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama", num_layers=2)
    source = resolve_model(str(folder))
    config = load_model_config(source)
    with pytest.raises(ValueError, match=r"\[1, 3\) is outside the model's 2 layers"):
        next(iter_weights(source, config, StageSpec(1, 2, 1, 3), torch.float32))
    four_layers = dataclasses.replace(config, num_hidden_layers=4)
    with pytest.raises(ValueError, match="no tensor 'model.layers.2.self_attn.q_proj.weight'"):
        list(iter_weights(source, four_layers, StageSpec(1, 2, 2, 4), torch.float32))


def test_gguf_stage_names() -> None:
    source = resolve_model(None)
    config = load_model_config(source)
    names = [
        name for name, _ in iter_weights(source, config, StageSpec(1, 2, 28, 30), torch.float32)
    ]
    assert set(names) == _expected_names(config, StageSpec(1, 2, 28, 30))
    assert len(names) == len(set(names))
    assert "model.embed_tokens.weight" in names  # tied: the last stage's lm_head


def test_gguf_weights_match_transformers_gguf_loader() -> None:
    """q/k rows are un-permuted as transformers' own GGUF loader does, shapes are HF's."""
    source = resolve_model(None)
    config = load_model_config(source)
    raw = {tensor.name: tensor for tensor in gguf.GGUFReader(source.path).tensors}
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})

    def reference(gguf_name: str) -> torch.Tensor:
        tensor = raw[gguf_name]
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return torch.from_numpy(processor.process(weights=weights, name=gguf_name).weights)

    ours = dict(iter_weights(source, config, StageSpec(0, 2, 29, 30), torch.float32))
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert torch.equal(ours["model.embed_tokens.weight"], reference("token_embd.weight"))
    for hf_part, gguf_part, shape in [
        ("q_proj", "attn_q", (576, 576)),
        ("k_proj", "attn_k", (192, 576)),
    ]:
        ours_qk = ours[f"model.layers.29.self_attn.{hf_part}.weight"]
        assert ours_qk.shape == shape
        assert torch.equal(ours_qk, reference(f"blk.29.{gguf_part}.weight"))
    assert ours["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)


def test_gguf_weights_make_smollm2_answer() -> None:
    """The real check of the q/k un-permutation: transformers' Llama with our weights answers.

    With the rows left as llama.cpp stores them, the same model outputs no sensible text.
    """
    source = resolve_model(None)
    config = load_model_config(source)
    tokenizer = load_tokenizer(source)
    hf_config = transformers.LlamaConfig(**config.hf_config_kwargs())
    model = transformers.LlamaForCausalLM(hf_config).eval()
    weights = dict(iter_weights(source, config, StageSpec(0, 1, 0, 30), torch.float32))
    result = model.load_state_dict(weights, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["lm_head.weight"], [])
    model.tie_weights()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, len(prompt) :].tolist())
