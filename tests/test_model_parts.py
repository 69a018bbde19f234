"""Unit tests for the model's speed-motivated parts: packed linears, fused loading, block reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipellm.kernels.cpu_kernels import why_unavailable
from pipellm.loader.source import load_model_config, resolve_model
from pipellm.loader.weights import iter_weights
from pipellm.model import linear
from pipellm.model.attention import gather_blocks
from pipellm.model.llama import LlamaStage
from pipellm.model.stage_spec import StageSpec
from tests.checkpoints import make_tiny_checkpoint


@pytest.mark.parametrize("kernel", ["pipellm", "onednn"])
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 65, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(96, 40), (100, 600)])
def test_packed_linear_matches_f_linear(
    monkeypatch, kernel, rows, with_bias, out_features, in_features
) -> None:
    """Both packed layouts; a ragged last panel (100 = 6 * 16 + 4) and, above 64 rows, x taken
    in 256-deep blocks (600 deep) exercise every branch of pipellm's kernel."""
    if kernel == "pipellm" and why_unavailable() is not None:
        pytest.skip(f"CPU kernels unavailable here: {why_unavailable()}")
    if kernel == "onednn":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("needs oneDNN")
        monkeypatch.setattr(linear, "cpu_kernels_available", lambda: False)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(2, rows, in_features, generator=generator)  # leading dims are kept
    layer = linear.PackedLinear(weight, bias)
    assert layer.own_kernel == (kernel == "pipellm")
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_fused_projections_load_in_any_checkpoint_order(tmp_path) -> None:
    directory = make_tiny_checkpoint(tmp_path / "m", arch="qwen2")  # q/k/v have biases
    source = resolve_model(str(directory))
    config = load_model_config(source)
    layers = config.num_hidden_layers
    weights = list(iter_weights(source, config, StageSpec(0, 1, 0, layers), torch.float32))
    stages = []
    for order in (weights, weights[::-1]):
        stage = LlamaStage(config, StageSpec(0, 1, 0, layers), torch.float32)
        stage.load_weights(order)
        stages.append(stage.state_dict())
    assert stages[0].keys() == stages[1].keys()
    assert all(torch.equal(stages[0][name], stages[1][name]) for name in stages[0])
    by_name = dict(weights)
    for kind in ("weight", "bias"):
        parts = [by_name[f"model.layers.1.self_attn.{p}_proj.{kind}"] for p in "qkv"]
        assert torch.equal(stages[0][f"layers.1.self_attn.qkv_proj.{kind}"], torch.cat(parts))


def test_missing_shard_is_reported(tmp_path) -> None:
    directory = make_tiny_checkpoint(tmp_path / "m")
    source = resolve_model(str(directory))
    config = load_model_config(source)
    weights = iter_weights(source, config, StageSpec(0, 2, 0, 2), torch.float32)
    stage = LlamaStage(config, StageSpec(0, 2, 0, 2), torch.float32)
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        stage.load_weights((n, t) for n, t in weights if n != "model.layers.1.mlp.up_proj.weight")


def test_gather_blocks_reads_slots_in_block_table_order() -> None:
    num_blocks, block_size, heads, dim = 6, 4, 2, 3
    cache = torch.arange(num_blocks * block_size * heads * dim, dtype=torch.float32)
    cache = cache.view(num_blocks, block_size, heads, dim)
    tables = torch.tensor([[3, 0], [5, 5]])
    slots = (tables.unsqueeze(-1) * block_size + torch.arange(block_size)).view(2, -1)
    expected = cache.view(-1, heads, dim)[slots]
    assert torch.equal(gather_blocks(cache, tables), expected)
