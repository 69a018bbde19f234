"""The GGUF-quantized linear: bit-identical to the float32 GEMM on `gguf`'s dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from pipellm.kernels.cpu_kernels import why_unavailable
from pipellm.model.gguf_linear import QuantizedLinear, QuantizedWeight, stack_rows

pytestmark = pytest.mark.skipif(
    why_unavailable() is not None, reason=f"CPU kernels unavailable: {why_unavailable()}"
)
KINDS = [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def quantized(kind, out_features: int, in_features: int, seed: int):
    """(QuantizedWeight, the float32 weight `gguf` dequantizes it to)."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).numpy()
    blocks = np.ascontiguousarray(quants.quantize(weight, kind))
    dequantized = quants.dequantize(blocks, kind).reshape(out_features, in_features)
    raw = torch.from_numpy(blocks).view(torch.uint8).reshape(out_features, -1)
    return QuantizedWeight(kind, raw), torch.from_numpy(dequantized.copy())


@pytest.mark.parametrize("kind", KINDS)
# 1-4 rows: dequantized in registers; 5-64: through a slice buffer, one pass; more: blocked.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 64, 65, 300])
@pytest.mark.parametrize("with_bias", [False, True])
# 40 = 2 * 16 + 8: a ragged last panel; 608 deep: 19 blocks, slices of 256 with a short last one.
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (96, 608)])
def test_bit_identical_to_float32_kernel(
    kernel_level, kernel_ops, kind, rows, with_bias, out_features, in_features
):
    weight, dequantized = quantized(kind, out_features, in_features, seed=rows)
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(2, rows, in_features, generator=generator)  # leading dims are kept
    layer = QuantizedLinear(weight, bias, level=kernel_level)
    assert layer.in_features == in_features
    packed = kernel_ops.pack_linear_weight(dequantized)
    rows_of_x = x.reshape(-1, in_features)
    expected = kernel_ops.packed_linear(rows_of_x, packed, bias, out_features)
    got = layer(x)
    assert got.shape == (2, rows, out_features)
    assert torch.equal(got.reshape(-1, out_features), expected)
    torch.testing.assert_close(got, F.linear(x, dequantized, bias), rtol=1e-4, atol=1e-4)


def test_stacked_rows_are_one_fused_projection():
    kind = GGMLQuantizationType.Q4_1
    parts = [quantized(kind, rows, 64, seed=rows) for rows in (32, 16, 16)]
    fused = QuantizedLinear(stack_rows([weight for weight, _ in parts]), None)
    x = torch.randn(3, 64)
    expected = torch.cat([F.linear(x, dequantized) for _, dequantized in parts], dim=-1)
    torch.testing.assert_close(fused(x), expected, rtol=1e-4, atol=1e-4)
    mixed = [parts[0][0], quantized(GGMLQuantizationType.Q8_0, 16, 64, seed=0)[0]]
    # Kinds that differ stay apart, each in its own (tests/test_gguf_types.py computes them).
    assert [part.kind for part in stack_rows(mixed).parts] == [kind, GGMLQuantizationType.Q8_0]


def test_bad_inputs_are_named(kernel_ops):
    weight, _ = quantized(GGMLQuantizationType.Q4_1, 16, 64, seed=0)
    layer = QuantizedLinear(weight, None)
    with pytest.raises(RuntimeError, match="not packed by gguf_linear"):
        kernel_ops.quantized_linear(torch.randn(2, 32), layer.packed_weight, 0, None, 16)
    with pytest.raises(RuntimeError, match="kind 0"):
        kernel_ops.quantized_linear(torch.randn(2, 64), layer.packed_weight, 7, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        kernel_ops.quantized_linear(torch.randn(2, 64), layer.packed_weight, 0, None, 40)
    with pytest.raises(RuntimeError, match="float32"):
        layer(torch.randn(2, 64, dtype=torch.float64))
