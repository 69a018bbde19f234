"""Rotary position embeddings, with the `rope_scaling` variants Llama-family configs state."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies, and the factor cos and sin are scaled by (yarn)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling, max_positions)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}"
    )


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between. A GGUF
    file stores the divisor of each pair instead (its `rope_freqs` tensor): `freq_factors`."""
    if "freq_factors" in scaling:
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(middle, blended, out)


def _yarn_frequencies(
    inv_freq: torch.Tensor,
    head_dim: int,
    theta: float,
    scaling: dict[str, Any],
    max_positions: int,
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): pairs that turn more than `beta_fast` times over the original
    context keep their frequency, pairs that turn fewer than `beta_slow` times are
    interpolated by `factor`, a linear ramp blends the ones between; attention logits are
    sharpened by 0.1 * ln(factor) + 1 through cos and sin."""
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_positions

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        weight, weight_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if weight and weight_all:
            attention_factor = mscale(factor, weight) / mscale(factor, weight_all)
        else:
            attention_factor = mscale(factor)

    def pair_turning(rotations: float) -> float:
        """The (fractional) pair index whose wavelength fits `rotations` times in the context."""
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = pair_turning(scaling.get("beta_fast") or 32)
    high = pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep, attention_factor


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position (HF's rotate-half layout)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype)
        # The sign of rotate-half's negated half, folded into the table once.
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for these positions, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]. The same values as HF's x * cos + rotate_half(x) * sin, in
    five ops instead of eight (it runs for every layer of every step)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
