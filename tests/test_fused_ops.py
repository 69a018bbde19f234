"""Fused RMSNorm / add + RMSNorm / per-head q/k RMSNorm / SiLU-and-mul / GELU-and-mul: the
kernels and the PyTorch fallback both match the plain formulas."""

import pytest
import torch
import torch.nn.functional as F

from pipellm.kernels.cpu_kernels import why_unavailable
from pipellm.model import fused_ops


@pytest.fixture(params=["kernels", "pytorch"])
def path(request, monkeypatch):
    if request.param == "kernels" and why_unavailable() is not None:
        pytest.skip(f"CPU kernels unavailable here: {why_unavailable()}")
    if request.param == "pytorch":
        monkeypatch.setattr(fused_ops, "kernels_apply", lambda x: False)
    return request.param


# 576: SmolLM2's width; 20: not a multiple of 8 (the scalar tails); 3000 rows: many threads.
SHAPES = [(1, 576), (16, 576), (3000, 64), (5, 20)]


def reference_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("rows,width", SHAPES)
def test_rms_norm(path, rows, width):
    x, weight = torch.randn(rows, width) * 3, torch.randn(width)
    got = fused_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, reference_norm(x, weight, 1e-5))


@pytest.mark.parametrize("rows,width", SHAPES)
def test_add_rms_norm_adds_in_place_and_leaves_the_residual(path, rows, width):
    x, residual, weight = torch.randn(rows, width), torch.randn(rows, width), torch.randn(width)
    total, residual_before = x + residual, residual.clone()
    got = fused_ops.add_rms_norm_(x, residual, weight, 1e-6)
    torch.testing.assert_close(x, total)
    torch.testing.assert_close(got, reference_norm(total, weight, 1e-6))
    assert torch.equal(residual, residual_before)


@pytest.mark.parametrize("rows,width", SHAPES)
def test_silu_and_mul(path, rows, width):
    gate_up = torch.randn(rows, 2 * width) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # saturated and zero gates
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 20])  # 20: the scalar tail
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (8, 2), (3, 3)])
@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_head_rms_norm_norms_query_and_key_heads_only(
    path, tokens, num_heads, num_kv_heads, head_dim
):
    generator = torch.Generator().manual_seed(tokens * 1000 + num_heads * 10 + head_dim)
    heads = num_heads + 2 * num_kv_heads
    qkv = torch.randn(tokens, heads, head_dim, generator=generator) * 5
    # Gemma's norm weights as loaded hold 1 + w; distinct q and k weights catch a swap.
    q_weight = 1 + torch.randn(head_dim, generator=generator)
    k_weight = 1 + torch.randn(head_dim, generator=generator)
    before = qkv.clone()
    got = fused_ops.head_rms_norm_(qkv, q_weight, k_weight, num_heads, num_kv_heads, 1e-6)
    if path == "kernels":
        assert got is qkv  # in place
    assert torch.equal(got[:, num_heads + num_kv_heads :], before[:, num_heads + num_kv_heads :])
    q, k = before[:, :num_heads], before[:, num_heads : num_heads + num_kv_heads]
    # float32 sums of squares in another order than ATen's, then products only: each output
    # within a few ulp (the kernel is ~2 ulp from a float64 norm).
    bound = {"rtol": 1e-6, "atol": 0.0}
    torch.testing.assert_close(got[:, :num_heads], reference_norm(q, q_weight, 1e-6), **bound)
    torch.testing.assert_close(
        got[:, num_heads : num_heads + num_kv_heads], reference_norm(k, k_weight, 1e-6), **bound
    )


# The outputs' sign, NaN and infinity as F.gelu's: at either side of a row's vector part and
# scalar tail (width 11 = 8 + 3).
SPECIAL_GATES = [float("inf"), float("-inf"), float("nan"), -1e20, 1e20, -3e38, 0.0, -0.0]


def gelu_tolerance(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """How far the kernel may be from F.gelu(gate, "tanh") * up: 1e-6 of the value (the kernel
    is ~2 ulp from float64 for gate > -1, up to ~|2z| ulp below, where e^-2z magnifies z's
    rounding), plus 1e-7 |gate up| for F.gelu's own error where 1 + tanh(z) cancels (up to a
    float32 ulp of 1, so 6e-8 |gate|, in its result; 30% of it at gate -5)."""
    return 1e-6 * (F.gelu(gate, approximate="tanh") * up).abs() + 1e-7 * (gate * up).abs()


@pytest.mark.parametrize("width", [11, 640, 2051])  # 640: Gemma 3 270M's hidden size
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_gelu_tanh_and_mul(path, rows, width):
    generator = torch.Generator().manual_seed(rows * width)
    gate_up = torch.randn(rows, 2 * width, generator=generator) * 4
    gate_up[0, :6] = torch.tensor([-12.0, -9.0, 12.0, 0.0, -4.0, 1e3])  # saturated, zero
    if rows > 1:
        gate_up[1, :width] *= 1e3  # large magnitudes; the cubic overflows past ~1e13
        gate_up[1, width:] = torch.randn(width, generator=generator) * 1e20
    gate, up = gate_up.chunk(2, dim=-1)
    got = fused_ops.gelu_tanh_and_mul(gate_up)
    reference = F.gelu(gate, approximate="tanh") * up
    assert got.shape == reference.shape
    excess = (got - reference).abs() - gelu_tolerance(gate, up)
    assert excess.max() <= 0, f"{excess.max()} past the bound at {divmod(excess.argmax(), width)}"


def test_gelu_tanh_and_mul_at_infinities_nan_and_zeros(path):
    gate = torch.tensor([SPECIAL_GATES[:3] + [1.0] * 5 + SPECIAL_GATES[-3:]])
    gate = torch.cat([gate, torch.tensor([SPECIAL_GATES[3:] + [1.0] * 3 + SPECIAL_GATES[:3]])])
    for up in (torch.full_like(gate, 2.0), torch.full_like(gate, -3e30)):
        got = fused_ops.gelu_tanh_and_mul(torch.cat([gate, up], 1))
        reference = F.gelu(gate, approximate="tanh") * up
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=0, equal_nan=True)
        numbers = ~reference.isnan()
        assert torch.equal(got.signbit()[numbers], reference.signbit()[numbers])


@pytest.mark.parametrize("rows,width", [(1, 49152), (16, 300), (3, 7), (2, 1)])
def test_argmax_rows_is_torch_argmax(path, rows, width):
    """The greedy sampler's argmax: the first maximum of a row (ties are common in logits
    rounded alike, or set to -inf by logits rules); a NaN counts as the largest, as in torch."""
    generator = torch.Generator().manual_seed(width)
    x = torch.randint(-3, 4, (rows, width), generator=generator).float()  # many ties
    x[0] = float("-inf")  # a row every rule masked
    if rows > 2:
        x[1, width // 2] = float("nan")
        x[1, -1] = float("nan")  # the first NaN wins
        x[2, -1] = 100.0  # the maximum in the scalar tail
    got = fused_ops.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(-1))
