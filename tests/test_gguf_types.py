"""Every GGUF type the kernels take, computed as stored: the exact path is bit-identical to
pipellm's float32 GEMM on the weights `gguf` dequantizes, the int8-activation path within the
bound that rounding x to 8 bits per 32 values (per 256 for the K-quants) allows, and the
embedding lookup returns `gguf`'s rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf_blocks import FLOAT_TYPES, QUANTIZED_TYPES, random_blocks

from pipellm.kernels.cpu_kernels import why_unavailable
from pipellm.model.gguf_linear import (
    GGUF_KERNEL_TYPES,
    GgufEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    stack_rows,
)

pytestmark = pytest.mark.skipif(
    why_unavailable() is not None, reason=f"CPU kernels unavailable: {why_unavailable()}"
)
T = GGMLQuantizationType
ALL_TYPES = QUANTIZED_TYPES + FLOAT_TYPES
# 512 deep: two 256-value K-quant blocks, or 16 blocks of 32; slices of 256 twice.
DEPTH = 512


def weight_of(kind: GGMLQuantizationType, rows: int, depth: int, seed: int):
    """(QuantizedWeight, float32 [rows, depth] as `gguf` dequantizes it)."""
    blocks = random_blocks(kind, rows, depth, seed)
    dequantized = quants.dequantize(blocks, kind).reshape(rows, depth)
    return QuantizedWeight(kind, torch.from_numpy(blocks)), torch.from_numpy(dequantized.copy())


def test_the_kernels_take_the_types_python_lists(kernel_ops):
    table = kernel_ops.gguf_kernel_types()
    rows = [table[i : i + 4] for i in range(0, len(table), 4)]
    assert {GGMLQuantizationType(row[0]) for row in rows} == GGUF_KERNEL_TYPES
    for ggml_type, block_values, block_bytes, int8 in rows:
        kind = GGMLQuantizationType(ggml_type)
        if kind not in FLOAT_TYPES:  # 16-bit floats run in pseudo-blocks of 32 values
            assert (block_values, block_bytes) == quants.GGML_QUANT_SIZES[kind]
        assert bool(int8) == (kind not in FLOAT_TYPES)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda kind: kind.name)
def test_embedding_rows_are_ggufs(kernel_level, kind):
    weight, dequantized = weight_of(kind, 24, DEPTH, seed=3)
    meta = torch.nn.Parameter(torch.empty(24, DEPTH, device="meta"))
    embedding = GgufEmbedding(weight, meta, level=kernel_level)
    ids = torch.tensor([[5, 0, 23], [5, 7, 11]])
    assert torch.equal(embedding(ids), dequantized[ids])
    with pytest.raises(RuntimeError, match="outside the table"):
        embedding(torch.tensor([24]))


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 64])
def test_exact_path_is_bit_identical_to_float32(kernel_level, kernel_ops, kind, rows):
    out_features = 40  # two whole panels of 16 and a ragged one
    weight, dequantized = weight_of(kind, out_features, DEPTH, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, DEPTH, generator=generator)
    layer = QuantizedLinear(weight, bias, level=kernel_level)
    packed = kernel_ops.pack_linear_weight(dequantized)
    expected = kernel_ops.packed_linear(x, packed, bias, out_features)
    assert torch.equal(layer(x), expected)


def int8_error_bound(x: torch.Tensor, weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """[rows, out] bound on |x W^T - int8 path|: x rounded per `group` values (32; 256 where
    llama.cpp rounds per 256 for K-quants) to a step of max|x| / 127 is off by at most half a
    step a value, times |w|; a step kept as float16 (per 32 values: llama.cpp's Q8_0/Q8_1) is
    off by 2^-11 of itself, so 127 steps by up to 127/2048 of a step, and Q8_1's sum term by as
    much again: 127/1024 of a step in all. Plus float32 slack."""
    rows, depth = x.shape
    step = x.abs().reshape(rows, depth // group, group).amax(-1) / 127
    allowance = 0.5 + (127 / 1024 if group == 32 else 0)
    steps = (step * allowance).repeat_interleave(group, dim=1)
    slack = 1e-5 * (x.abs() @ weight.abs().T) + 1e-6
    return steps @ weight.abs().T + slack


# The K-quants' int8 path rounds x per 256 values, as llama.cpp's Q8_K does.
K_QUANTS = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS})


@pytest.mark.parametrize("kind", QUANTIZED_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_int8_path_within_the_rounding_bound(kernel_level, kind, rows):
    out_features = 40
    weight, dequantized = weight_of(kind, out_features, DEPTH, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, DEPTH, generator=generator)
    layer = QuantizedLinear(weight, bias, level=kernel_level, int8_activations=True)
    assert layer.int8_activations
    reference = (x.double() @ dequantized.double().T + bias.double()).float()
    error = (layer(x) - reference).abs()
    bound = int8_error_bound(x, dequantized, 256 if kind in K_QUANTS else 32)
    assert (error <= bound).all(), (error / bound).max()
    # Not the exact path's numbers: x really is rounded.
    assert not torch.equal(layer(x), QuantizedLinear(weight, bias, level=kernel_level)(x))


@pytest.mark.parametrize("int8_activations", [False, True])
def test_parts_of_different_types_stay_in_their_types(kernel_level, kernel_ops, int8_activations):
    # 24 + 8 + 40 rows: panels of 16 straddle the parts.
    parts = [
        weight_of(kind, rows, DEPTH, seed=rows)
        for kind, rows in ((T.Q5_0, 24), (T.Q8_0, 8), (T.Q6_K, 40))
    ]
    stacked = stack_rows([weight for weight, _ in parts])
    assert stacked.kind == "Q5_0+Q8_0+Q6_K"
    dequantized = torch.cat([d for _, d in parts])
    x = torch.randn(3, DEPTH, generator=torch.Generator().manual_seed(0))
    layer = QuantizedLinear(stacked, None, level=kernel_level, int8_activations=int8_activations)
    got = layer(x)
    if int8_activations:
        # Each part's x rounded as for its type: the Q6_K rows per 256 values.
        bound = torch.cat(
            [int8_error_bound(x, dequantized[:32]), int8_error_bound(x, dequantized[32:], 256)], 1
        )
        assert ((got - x.double().matmul(dequantized.double().T).float()).abs() <= bound).all()
    else:
        expected = kernel_ops.packed_linear(x, kernel_ops.pack_linear_weight(dequantized), None, 72)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("kinds", [(T.Q5_0,), (T.Q5_0, T.Q8_0, T.Q5_0)], ids=["Q5_0", "Q5_0+Q8_0"])
def test_q5_0_is_repacked_and_bit_identical(kernel_level, kernel_ops, rows, kinds):
    # Q5_0 alone keeps its 5.5 bits in the repacked layout; a q/k/v of Q5_0 and Q8_0 parts is
    # widened to Q8_0 (the same products), so both take the repacked kernel.
    parts = [weight_of(kind, 24, DEPTH, seed=i) for i, kind in enumerate(kinds)]
    dequantized = torch.cat([d for _, d in parts])
    weight = stack_rows([w for w, _ in parts])
    layer = QuantizedLinear(weight, None, level=kernel_level)
    assert layer.repacked and layer.kernel_kind == (2 if len(kinds) == 1 else 1)
    if len(kinds) == 1:  # as many bytes as the file's blocks, but for panel padding
        assert layer.packed_weight.numel() == -(-24 // 16) * 16 * weight.blocks.shape[1]
    x = torch.randn(rows, DEPTH, generator=torch.Generator().manual_seed(rows))
    packed = kernel_ops.pack_linear_weight(dequantized)
    expected = kernel_ops.packed_linear(x, packed, None, dequantized.shape[0])
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize(
    "kinds",
    [(T.Q5_0,), (T.Q5_0, T.Q8_0, T.Q5_0), (T.Q4_K,), (T.Q6_K,)],
    ids=["Q5_0", "Q5_0+Q8_0", "Q4_K", "Q6_K"],
)
def test_int8_repacked_types_within_the_rounding_bound(kernel_level, kinds):
    # Under int8 activations too: Q5_0 in its own 5.5-bit records, a q/k/v of Q5_0 and Q8_0
    # parts widened to Q8_0, Q4_K and Q6_K in the exact kernel's record size (Q4_K's 6-bit
    # scales as bytes: 64 more a record). 1-3 rows are the AVX2 kernel's register blocks.
    parts = [weight_of(kind, 24, DEPTH, seed=i) for i, kind in enumerate(kinds)]
    dequantized = torch.cat([d for _, d in parts])
    weight = stack_rows([w for w, _ in parts])
    layer = QuantizedLinear(weight, None, level=kernel_level, int8_activations=True)
    assert layer.repacked and layer.int8_activations
    assert layer.kernel_kind == (
        1 if len(kinds) > 1 else {T.Q5_0: 2, T.Q6_K: 3, T.Q4_K: 4}[kinds[0]]
    )
    if len(kinds) == 1:
        extra = 64 * 2 * 2 if kinds[0] == T.Q4_K else 0  # 2 panels x 2 records
        assert layer.packed_weight.numel() == 32 * weight.blocks.shape[1] + extra
    for rows in (1, 2, 3, 64):
        x = torch.randn(rows, DEPTH, generator=torch.Generator().manual_seed(rows))
        reference = (x.double() @ dequantized.double().T).float()
        error = (layer(x) - reference).abs()
        assert (error <= int8_error_bound(x, dequantized)).all()


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("kind", [T.Q6_K, T.Q4_K], ids=lambda kind: kind.name)
def test_k_quants_are_repacked_and_bit_identical(kernel_level, kernel_ops, rows, kind):
    # 40 rows: two whole panels and a ragged one; 512 deep: two 256-value records.
    weight, dequantized = weight_of(kind, 40, DEPTH, seed=rows)
    layer = QuantizedLinear(weight, None, level=kernel_level)
    assert layer.repacked and layer.kernel_kind == {T.Q6_K: 3, T.Q4_K: 4}[kind]
    # Q6_K: the file's bytes; Q4_K: 64 more a record (its 6-bit scales and mins as bytes).
    extra = {T.Q6_K: 0, T.Q4_K: 64 * 2 * 3}[kind]
    assert layer.packed_weight.numel() == 48 * weight.blocks.shape[1] + extra
    x = torch.randn(rows, DEPTH, generator=torch.Generator().manual_seed(rows))
    expected = kernel_ops.packed_linear(x, kernel_ops.pack_linear_weight(dequantized), None, 40)
    assert torch.equal(layer(x), expected)


def test_float16_types_keep_the_exact_path_under_int8(kernel_level):
    weight, dequantized = weight_of(T.F16, 16, 64, seed=0)
    layer = QuantizedLinear(weight, None, level=kernel_level, int8_activations=True)
    assert not layer.int8_activations
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ dequantized.T, rtol=1e-5, atol=1e-6)


def test_a_row_of_the_wrong_size_is_refused(kernel_ops):
    blocks = torch.from_numpy(random_blocks(T.Q4_K, 16, 256, seed=0))
    with pytest.raises(RuntimeError, match="Q4_K part of 144 bytes a row does not hold 512"):
        kernel_ops.gguf_linear(torch.randn(1, 512), [blocks], [int(T.Q4_K)], None, 16)
    with pytest.raises(RuntimeError, match="GGUF type 16 has no kernel"):
        kernel_ops.gguf_linear(torch.randn(1, 256), [blocks], [16], None, 16)


def test_random_blocks_are_finite():
    for kind in ALL_TYPES:
        assert np.isfinite(quants.dequantize(random_blocks(kind, 2, 256, 0), kind)).all()
