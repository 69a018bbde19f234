"""Runtime dispatch of pipellm's CPU kernels: the level chosen for this CPU, PIPELLM_CPU_ISA,
and the same bits from every level this machine runs where the arithmetic is the same."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_blocks import random_blocks

from pipellm.kernels import cpu_kernels
from pipellm.model.gguf_linear import (
    EXACT_KERNEL_KINDS,
    KERNEL_KINDS,
    QuantizedWeight,
    pack_int8_weight,
    pack_quantized_weight,
)
from tests.test_decode_attention_kernel import random_paged_cache
from tests.test_quantized_linear import quantized

T = GGMLQuantizationType
LEVELS = cpu_kernels.supported_levels() if cpu_kernels.why_unavailable() is None else []
needs_kernels = pytest.mark.skipif(not LEVELS, reason="CPU kernels unavailable here")


def test_levels_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    avx2 = {"avx2", "fma", "f16c", "sse4_2"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(avx2))
    assert cpu_kernels.supported_levels() == ["avx2"]
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(avx512))
    assert cpu_kernels.supported_levels() == ["avx2", "avx512"]
    assert cpu_kernels.chosen_level() == "avx512"  # the best, unless forced
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "avx2")
    assert cpu_kernels.chosen_level() == "avx2"
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset(avx512 - {"avx512bw"}))
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "avx512")
    with pytest.raises(ValueError, match="does not support it"):
        cpu_kernels.chosen_level()  # forced: not silently another level
    monkeypatch.delenv(cpu_kernels.LEVEL_ENV)
    assert cpu_kernels.chosen_level() == "avx2"  # AVX-512F without BW is not the avx512 level
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert "AVX2" in cpu_kernels.why_unavailable()


def test_a_bad_level_setting_is_named(monkeypatch):
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, "avx9000")
    with pytest.raises(ValueError, match="PIPELLM_CPU_ISA='avx9000'.*avx2, avx512"):
        cpu_kernels.chosen_level()


@needs_kernels
def test_the_chosen_level_is_logged(monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernels.LEVEL_ENV, LEVELS[0])
    cpu_kernels.cpu_kernels_available.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
            assert cpu_kernels.cpu_kernels_available()
        assert f"pipellm CPU kernels: {LEVELS[0]}" in caplog.text
    finally:
        cpu_kernels.cpu_kernels_available.cache_clear()


def same_on_every_level(run) -> None:
    """run(ops) -> tensors; every level this machine runs must give the same bits."""
    results = {level: run(cpu_kernels.ops(level)) for level in LEVELS}
    first, *_ = results.values()
    for level, tensors in results.items():
        for got, expected in zip(tensors, first, strict=True):
            assert torch.equal(got, expected), f"{level} differs from {LEVELS[0]}"


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 65, 200, 400])
def test_gemms_bit_identical_across_levels(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 608, generator=generator)
    weight = torch.randn(72, 608, generator=generator)  # 4 panels and a half
    bias = torch.randn(72, generator=generator)
    packed = cpu_kernels.ops(LEVELS[0]).pack_linear_weight(weight)  # one layout for all levels
    weights = {
        kind: quantized(kind, 72, 608, seed=rows)[0]
        for kind in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
    }
    # Q5_0 and the K-quants (random blocks in the file's layout; 512 deep: two 256-value
    # blocks), which the VNNI kernel takes too.
    x_k = torch.randn(rows, 512, generator=generator)
    k_weights = {
        kind: QuantizedWeight(kind, torch.from_numpy(random_blocks(kind, 72, 512, seed=rows)))
        for kind in (T.Q5_0, T.Q4_K, T.Q6_K)
    }

    def run(ops):
        outs = [ops.packed_linear(x, packed, bias, 72), ops.packed_linear(x, packed, None, 72)]
        for kind, weight in weights.items():
            outs.append(
                ops.quantized_linear(x, pack_quantized_weight(weight), KERNEL_KINDS[kind], bias, 72)
            )
            # The int8 GEMM: VNNI on an AVX-512 VNNI CPU, vpmaddubsw on AVX2, the same sums.
            outs.append(
                ops.quantized_linear_int8(x, pack_int8_weight(weight), KERNEL_KINDS[kind], bias, 72)
            )
        for kind, weight in k_weights.items():
            kernel_kind = EXACT_KERNEL_KINDS[kind]
            outs.append(
                ops.quantized_linear(x_k, pack_quantized_weight(weight), kernel_kind, bias, 72)
            )
            packed_int8 = pack_int8_weight(weight)
            outs.append(ops.quantized_linear_int8(x_k, packed_int8, kernel_kind, bias, 72))
            outs.append(ops.quantized_linear_int8(x_k, packed_int8, kernel_kind, None, 72))
        return outs

    same_on_every_level(run)


@needs_kernels
@pytest.mark.parametrize("length", [5, 64, 150])
def test_attention_and_fused_ops_bit_identical_across_levels(length):
    generator = torch.Generator().manual_seed(length)
    qkv = torch.randn(length, 15, 64, generator=generator)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    lens = [1, 17, length]
    k_cache, v_cache, tables = random_paged_cache(lens, 16, 3, 64, seed=length)
    query = torch.randn(len(lens), 9, 64, generator=generator)
    x, residual = torch.randn(length, 576, generator=generator), torch.randn(length, 576)
    norm_weight = torch.randn(576, generator=generator)
    cos, sin = torch.randn(length, 64), torch.randn(length, 64)
    slots = torch.randperm(k_cache.shape[0] * 16, generator=generator)[:length]

    def run(ops):
        prefill, decode = torch.empty(q.shape), torch.empty(query.shape)
        ops.prefill_attention(prefill, q, k, v, 0.125)
        ops.paged_decode_attention(
            decode, query, k_cache, v_cache, tables, torch.tensor(lens), 0.125
        )
        summed = x.clone()
        normed = ops.add_rms_norm_(summed, residual, norm_weight, 1e-5)
        rotated, caches = qkv.clone(), (torch.zeros_like(k_cache), torch.zeros_like(v_cache))
        ops.rotary_and_cache_(rotated, cos, sin, *caches, slots, 9, 3)
        head_normed = qkv.clone()
        ops.head_rms_norm_(head_normed, norm_weight[:64], norm_weight[64:128], 9, 3, 1e-6)
        return [
            prefill,
            decode,
            summed,
            normed,
            ops.rms_norm(x, norm_weight, 1e-6),
            ops.silu_and_mul(x),
            ops.gelu_tanh_and_mul(x * 4),
            head_normed,
            rotated,
            *caches,
        ]

    same_on_every_level(run)
