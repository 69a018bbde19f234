"""Linear layers whose weights are packed once, at load, for a faster CPU GEMM (float32).

pipellm's own kernel (pipellm/kernels/packed_linear.cpp) where it builds; otherwise oneDNN's
blocked layout. Measured on the 2-core AVX2 CPU, SmolLM2 shapes, weights streamed from memory
as in a real step (docs/performance.md): at decode sizes F.linear (MKL) is far from the memory
bound; oneDNN's prepacked kernel is 20-30% faster for the layer projections and 2-3x for the
49152-wide lm_head; pipellm's kernel takes about a third less time again, and is as fast as
MKL at prefill sizes.
"""

from __future__ import annotations

import torch
from torch import nn

from pipellm.kernels.cpu_kernels import cpu_kernels_available, ops
from pipellm.model.gguf_linear import QuantizedLinear, QuantizedWeight, on_rows

# oneDNN picks the blocked layout for this many rows; measured: any value serves all row counts.
_PACK_ROWS_HINT = 16


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and (cpu_kernels_available() or torch.backends.mkldnn.is_available())
    )


class PackedLinear(nn.Module):
    """y = x W^T + b, with W held only in the packed layout (the plain copy is dropped)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.own_kernel = cpu_kernels_available()
        if self.own_kernel:
            self.packed_weight = ops().pack_linear_weight(weight.contiguous())
            self.linear_op = ops().packed_linear
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own_kernel:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        return on_rows(self.linear_op, x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        kind = "pipellm" if self.own_kernel else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


def prepack_linears(
    module: nn.Module,
    quantized: dict[str, QuantizedWeight],
    prefix: str = "",
    int8_activations: bool = False,
) -> None:
    """Replaces every nn.Linear below `module` by a QuantizedLinear where `quantized` has its
    GGUF weight (by qualified name; its float32 weight may never have been loaded; with
    `int8_activations`, the int8 kernel), else by a PackedLinear, where the CPU allows."""
    for name, child in module.named_children():
        qualified = prefix + name
        if isinstance(child, nn.Linear):
            if qualified in quantized:
                layer = QuantizedLinear(
                    quantized[qualified], child.bias, int8_activations=int8_activations
                )
                setattr(module, name, layer)
            elif can_prepack(child.weight):
                setattr(module, name, PackedLinear(child.weight.detach(), child.bias))
        else:
            prepack_linears(child, quantized, qualified + ".", int8_activations)
