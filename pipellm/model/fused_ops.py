"""RMSNorm (with the residual add before it, or over each query and key head), SiLU-and-mul,
GELU-and-mul and the sampler's argmax, on pipellm's fused CPU kernels
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


def head_rms_norm_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """qkv [T, H + 2 Hkv, D]: each query head RMS-normed with q_weight and each key head with
    k_weight (Qwen3's and Gemma 3's q/k norms), value heads as they are. In place where the
    kernel takes qkv (a fresh projection output of the caller's), else a new tensor."""
    if kernels_apply(qkv) and qkv.dim() == 3 and qkv.is_contiguous():
        ops().head_rms_norm_(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)
        return qkv
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    width = (qkv.shape[-1],)
    q, k = F.rms_norm(q, width, q_weight, eps), F.rms_norm(k, width, k_weight, eps)
    return torch.cat([q, k, v], dim=1)


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
