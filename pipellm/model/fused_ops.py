"""RMSNorm (with the residual add before it), SiLU-and-mul, GELU-and-mul and the sampler's
argmax, on pipellm's fused CPU kernels
(pipellm/kernels/elementwise.cpp) where they apply, else in plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipellm.kernels.cpu_kernels import kernels_apply, ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if kernels_apply(x) and x.dim() == 2:
        return ops().rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += residual, in place (x carries the residual stream from here), and returns
    rms_norm(x). x must be a fresh tensor of the caller's, e.g. a projection's output."""
    if kernels_apply(x) and x.dim() == 2 and x.is_contiguous():
        return ops().add_rms_norm_(x, residual.contiguous(), weight, eps)
    x.add_(residual)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 I], gate then up. Returns silu(gate) * up, [..., I]."""
    if kernels_apply(gate_up) and gate_up.dim() == 2:
        return ops().silu_and_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 I], gate then up. Returns gelu(gate) * up with GELU's tanh
    approximation (GeGLU, as Gemma's `gelu_pytorch_tanh`), [..., I]."""
    if kernels_apply(gate_up) and gate_up.dim() == 2:
        return ops().gelu_tanh_and_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: [S, V]. Each row's argmax, int64 [S], as logits.argmax(-1) (the first maximum;
    a NaN counts as the largest): the greedy token. ATen's reduction takes ~105 us a 49152-wide
    row on this CPU (~1% of a one-sequence step), the kernel ~10."""
    if kernels_apply(logits) and logits.dim() == 2 and logits.shape[1] > 0:
        return ops().argmax_rows(logits.contiguous())
    return logits.argmax(-1)
