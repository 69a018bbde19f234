"""The int8-activation GEMM (`quantization="gguf_int8"`): x rounded to int8 per 32
values, integer dot products against the GGUF blocks (AVX-512 VNNI, or AVX2's vpmaddubsw +
vpmaddwd), at every kernel level this machine runs. Not bit-identical to float32 by design;
checked against the same arithmetic done in float64, and near the float32 result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from pipellm.kernels.cpu_kernels import int8_activations_unavailable
from pipellm.model.gguf_linear import QuantizedLinear
from tests.test_quantized_linear import KINDS, quantized

pytestmark = pytest.mark.skipif(
    int8_activations_unavailable() is not None,
    reason=f"int8 activations unavailable: {int8_activations_unavailable()}",
)


def reference(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in float64: x's blocks rounded to int8 in float32 as llama.cpp
    rounds them for these types (q = round-half-even(x * 127 / max|x|), dx = max|x| / 127 as
    float16), then per block d dx sum(q qx) (+ m s for Q4_1, s = dx sum(qx) from the float32
    dx, as float16), summed over blocks."""
    xs = x.reshape(x.shape[0], -1, 32).numpy()
    amax = np.abs(xs).max(axis=-1, keepdims=True)
    safe = np.where(amax > 0, amax, 1)
    inverse = np.where(amax > 0, np.float32(127) / safe, 0).astype(np.float32)
    qx = np.clip(np.rint((xs * inverse).astype(np.float32)), -127, 127)
    dx32 = (amax / np.float32(127)).astype(np.float32)
    dx = dx32.astype(np.float16).astype(np.float64)
    rows = weight.blocks.shape[0]
    blocks = weight.blocks.view(rows, -1, weight.blocks.shape[1] // (x.shape[1] // 32)).numpy()
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [rows, blocks]
    if weight.kind == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        packed = blocks[..., 4:20]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float64)
    else:
        m = np.zeros_like(d)
        q = blocks[..., 2:34].copy().view(np.int8).astype(np.float64)
    dots = np.einsum("rbk,obk->rob", qx.astype(np.float64), q)  # exact integers
    sums = qx.sum(axis=-1).astype(np.float32)  # [rows of x, blocks]
    s = (dx32[..., 0] * sums).astype(np.float16).astype(np.float64)
    out = (dots * d[None] * dx[:, None, :, 0]).sum(-1) + (m[None] * s[:, None]).sum(-1)
    if bias is not None:
        out = out + bias.double().numpy()
    return torch.from_numpy(out)


@pytest.mark.parametrize("kind", KINDS)
# VNNI: 1-2 rows 4 panels at once, 3-4 rows 2; AVX2: 1 row 2 panels, 2-3 rows 1. 5 and 9:
# near-equal register blocks; 260: two 256-row chunks. A bias at odd row counts.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 260])
# 40 = 2 * 16 + 8: a ragged last panel; 608 deep: 19 blocks; 160 columns: 10 panels, so a
# thread's run ends in a group of fewer than 4.
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (160, 608)])
def test_int8_activations_compute_the_rounded_products(
    kernel_level, kind, rows, out_features, in_features
):
    weight, dequantized = quantized(kind, out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=generator) if rows % 2 else None
    x = torch.randn(rows, in_features, generator=generator)
    x[0, :32] = 0  # an all-zero block: scale 0, not a division by zero
    layer = QuantizedLinear(weight, bias, level=kernel_level, int8_activations=True)
    got = layer(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    # x to 8 bits: near the float32 product, not equal to it.
    exact = F.linear(x, dequantized, bias)
    error = (got - exact).norm() / exact.norm()
    assert 0 < error < 0.02


def test_int8_activations_track_the_exact_path_on_real_scale_inputs(kernel_level):
    """Many rows of a realistic projection: the int8 result keeps the float32 result's
    largest output (what a greedy next token depends on) for nearly every row."""
    weight, dequantized = quantized(GGMLQuantizationType.Q8_0, 512, 576, seed=7)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(7))
    got = QuantizedLinear(weight, None, level=kernel_level, int8_activations=True)(x)
    agree = (got.argmax(-1) == F.linear(x, dequantized).argmax(-1)).float().mean()
    assert agree >= 0.9


def test_bad_inputs_are_named(kernel_level, kernel_ops):
    weight, _ = quantized(GGMLQuantizationType.Q4_1, 16, 64, seed=0)
    layer = QuantizedLinear(weight, None, level=kernel_level, int8_activations=True)
    with pytest.raises(RuntimeError, match="not packed by pack_int8_weight"):
        kernel_ops.quantized_linear_int8(torch.randn(2, 32), layer.packed_weight, 0, None, 16)
    with pytest.raises(RuntimeError, match="not packed by pack_int8_weight"):
        kernel_ops.quantized_linear_int8(torch.randn(2, 64), layer.packed_weight, 1, None, 16)
    with pytest.raises(RuntimeError, match="float32"):
        layer(torch.randn(2, 64, dtype=torch.float64))
