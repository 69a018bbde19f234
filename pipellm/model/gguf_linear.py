"""Linear layers that compute on a GGUF file's quantized weights (Q4_1, Q8_0) as they are.

A decode step streams every weight once, so on a CPU its time is the weights' bytes over the
memory bandwidth. Kept at 4-5 bits (Q4_1) or 8.5 bits (Q8_0) a weight instead of 32, the
stream is 4-6x smaller. pipellm's kernel (pipellm/kernels/quantized_linear.cpp) dequantizes
slice by slice into cache and multiplies there; its results are bit-identical to those of the
float32 weights `gguf` dequantizes (see the kernel's header for why), so the model computes
exactly the same numbers, only faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pipellm.kernels.cpu_kernels import ops

PANEL = 16  # output columns per panel, as in the kernel
BLOCK = 32  # input rows per GGUF block
# GGUF type -> the kernel's `kind` argument.
KERNEL_KINDS = {GGMLQuantizationType.Q4_1: 0, GGMLQuantizationType.Q8_0: 1}


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight matrix in GGUF's own bytes: row r of W is blocks[r], its 32-value blocks."""

    kind: GGMLQuantizationType
    blocks: torch.Tensor  # uint8 [out_features, in_features / 32 * bytes per block]

    @property
    def in_features(self) -> int:
        block_values, block_bytes = GGML_QUANT_SIZES[self.kind]
        return self.blocks.shape[1] // block_bytes * block_values


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The weights stacked along their output rows (fused q/k/v, gate/up); None if their kinds
    differ, since one kernel call takes one kind."""
    if len({part.kind for part in parts}) != 1:
        return None
    return QuantizedWeight(parts[0].kind, torch.cat([part.blocks for part in parts]))


def on_rows(op: Callable[..., torch.Tensor], x: torch.Tensor, *args: object) -> torch.Tensor:
    """op(rows of x, *args) for a kernel that takes 2-D x: leading dims of x are flattened and
    restored around it. The model's own input is already 2-D and skips both reshapes (~4 us a
    call, 121 calls a step)."""
    if x.dim() == 2:
        return op(x, *args)
    y = op(x.reshape(-1, x.shape[-1]), *args)
    return y.view(*x.shape[:-1], y.shape[-1])


def _float16(pairs: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 holding little-endian float16 values -> [...] float16."""
    return pairs.contiguous().view(torch.float16).squeeze(-1)


def _by_panels(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(scales, mins or None, quants) of the weight by panel of 16 output columns and 32-row
    block: float16 [panels, blocks, 16] twice, then [panels, blocks, 32 (depth), 16 (column)]
    (uint8 0..15 for Q4_1, int8 for Q8_0). Padded columns get zero scales and mins: they come
    out 0."""
    rows = weight.blocks.shape[0]
    num_blocks = weight.in_features // BLOCK
    blocks = weight.blocks.view(rows, num_blocks, -1)
    panels = -(-rows // PANEL)
    pad = panels * PANEL - rows

    def by_panel(values: torch.Tensor) -> torch.Tensor:
        """[rows, blocks, *rest] -> [panels, blocks, *rest, 16], zero-padded."""
        values = torch.cat([values, values.new_zeros(pad, *values.shape[1:])])
        values = values.view(panels, PANEL, *values.shape[1:])
        return values.movedim(1, -1).contiguous()

    scales = by_panel(_float16(blocks[..., 0:2]))
    if weight.kind == GGMLQuantizationType.Q4_1:
        mins = by_panel(_float16(blocks[..., 2:4]))
        packed_q = blocks[..., 4:20]  # value i in the low nibble of byte i, i + 16 in the high
        q = torch.cat([packed_q & 0x0F, packed_q >> 4], dim=-1)  # [rows, blocks, 32]
        return scales, mins, by_panel(q)
    return scales, None, by_panel(blocks[..., 2:34].contiguous().view(torch.int8))


def _records(*parts: torch.Tensor) -> torch.Tensor:
    """Each part [panels, blocks, ...] as bytes, joined into one record per (panel, block)."""
    panels, num_blocks = parts[0].shape[:2]
    return torch.cat(
        [part.contiguous().view(torch.uint8).reshape(panels, num_blocks, -1) for part in parts],
        dim=-1,
    )


def pack_quantized_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The exact kernel's layout: [panels, in_features / 32, record] uint8, one record per
    panel of 16 output columns and 32-row block (see pipellm/kernels/quantized_linear.cpp).
    Scales (and mins) stay float16, as in the file: the kernel widens them exactly (F16C)."""
    scales, mins, q = _by_panels(weight)
    if mins is not None:
        pairs = q[..., :8] | (q[..., 8:] << 4)  # byte j: column j low, column j + 8 high
        return _records(scales, mins, pairs)
    return _records(scales, q)


def pack_int8_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The int8 kernel's layout (pipellm/kernels/int8_linear.cpp): per record, 4
    consecutive depths of a column in each 32-bit lane, as vpdpbusd multiplies them."""
    scales, mins, q = _by_panels(weight)
    panels, num_blocks = q.shape[:2]

    def lanes(values: torch.Tensor, groups: int) -> torch.Tensor:
        """[P, B, 4 groups, 16 columns] -> [P, B, groups, 16 columns, 4 depths]."""
        return values.view(panels, num_blocks, groups, 4, PANEL).transpose(-1, -2)

    if mins is not None:  # depth 4 i + t in the low nibble, 16 + 4 i + t in the high
        nibbles = lanes(q[:, :, :16], 4) | (lanes(q[:, :, 16:], 4) << 4)
        return _records(scales, mins, nibbles)
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)  # vpdpbusd takes u8 weights
    return _records(scales, lanes(shifted, 8))


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W in a GGUF quantized format, for float32 x on the CPU."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        level: str | None = None,
        int8_activations: bool = False,
    ) -> None:
        """level: the kernels' instruction-set level (default: the one chosen for this CPU).
        int8_activations: x rounded to int8 per 32 values and integer dot products
        (`quantization="gguf_int8"`: faster, not bit-identical to float32)."""
        super().__init__()
        self.out_features, self.in_features = weight.blocks.shape[0], weight.in_features
        self.bias = bias
        self.kind = weight.kind
        self.kernel_kind = KERNEL_KINDS[weight.kind]
        self.int8_activations = int8_activations
        if int8_activations:
            self.packed_weight = pack_int8_weight(weight)
            self.linear_op = ops(level).quantized_linear_int8
        else:
            self.packed_weight = pack_quantized_weight(weight)
            self.linear_op = ops(level).quantized_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(
            self.linear_op,
            x,
            self.packed_weight,
            self.kernel_kind,
            self.bias,
            self.out_features,
        )

    def extra_repr(self) -> str:
        int8 = ", int8 activations" if self.int8_activations else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.kind.name}{int8}"
        )
