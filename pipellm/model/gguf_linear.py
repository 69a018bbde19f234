"""Linear layers that compute on a GGUF file's weights in the file's own types.

A decode step streams every weight once, so on a CPU its time is the weights' bytes over the
memory bandwidth. Kept at 2.6-8.5 bits a weight instead of 32, the stream is 4-12x smaller.
Q4_1, Q8_0, Q5_0, Q4_K and Q6_K matrices (the types of llama.cpp's Q4_0/Q4_K_M/Q6_K mixes but
Q4_0) are repacked at load into panels of 16 interleaved rows, for the exact kernel
(pipellm/kernels/quantized_linear.cpp) and the int8 one (int8_linear.cpp), at their file size
(Q4_K 3% more: its 6-bit scales unpacked); a fused q/k/v of Q5_0 and Q8_0 parts is widened to
Q8_0 (the same products). Every other type the kernels take (GGUF_KERNEL_TYPES) computes on
the file's row-major blocks as they are (pipellm/kernels/gguf_linear.cpp), and a fused q/k/v
or gate/up whose parts the file stores in other mixes of types keeps each part in its own
type. Both exact kernels are bit-identical to the float32 GEMM on the weights `gguf`
dequantizes (see their headers for why), so the model computes exactly the same numbers, only
faster; with int8 activations (`quantization="gguf_int8"`) x is rounded to 8 bits per 32
values, as llama.cpp's dot products do.
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
_T = GGMLQuantizationType
# GGUF type -> the repacking kernels' `kind` argument (quantized_linear.cpp, int8_linear.cpp).
KERNEL_KINDS = {_T.Q4_1: 0, _T.Q8_0: 1}
# Both repacked kernels also take Q5_0, the type llama.cpp's K-quant mixes fall back to for
# rows whose width is not a multiple of 256 (most of a small model's), and Q6_K and Q4_K
# (llama.cpp's Q6_K files, the rest of its Q4_K_M mixes).
EXACT_KERNEL_KINDS = {**KERNEL_KINDS, _T.Q5_0: 2, _T.Q6_K: 3, _T.Q4_K: 4}
# Every type the GGUF kernels take as stored (gguf_type_table.cpp; a test checks the two agree).
GGUF_KERNEL_TYPES = frozenset(
    {
        _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0,
        _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
        _T.IQ4_NL, _T.IQ4_XS,
        _T.F16, _T.BF16,
    }
)  # fmt: skip
# Types with no int8-activation path: their exact path streams the same 16-bit values.
FLOAT_TYPES = frozenset({_T.F16, _T.BF16})


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight matrix in GGUF's own bytes: row r of W is blocks[r], its 32-value blocks."""

    kind: GGMLQuantizationType
    blocks: torch.Tensor  # uint8 [out_features, in_features / 32 * bytes per block]

    @property
    def in_features(self) -> int:
        block_values, block_bytes = GGML_QUANT_SIZES[self.kind]
        return self.blocks.shape[1] // block_bytes * block_values

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def parts(self) -> tuple[QuantizedWeight, ...]:
        return (self,)


@dataclass(frozen=True)
class StackedWeight:
    """Weights of different GGUF types stacked along their output rows (a fused q/k/v or
    gate/up whose parts the file stores in different types): each part keeps its type."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def kind(self) -> str:
        return "+".join(part.kind.name for part in self.parts)


GgufWeight = QuantizedWeight | StackedWeight


def stack_rows(parts: list[QuantizedWeight]) -> GgufWeight:
    """The weights stacked along their output rows (fused q/k/v, gate/up): one tensor where
    they share a type, else a StackedWeight that keeps each in its own."""
    if len({part.kind for part in parts}) != 1:
        return StackedWeight(tuple(parts))
    if len(parts) == 1:
        return parts[0]
    return QuantizedWeight(parts[0].kind, torch.cat([part.blocks for part in parts]))


def has_int8_path(weight: GgufWeight) -> bool:
    """Whether every part of the weight has an int8-activation kernel (16-bit floats do not)."""
    return all(part.kind not in FLOAT_TYPES for part in weight.parts)


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


def _q5_0_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks [rows, blocks, 22] -> their unsigned 5-bit q [rows, blocks, 32] (uint8):
    value j's low nibble in byte 6 + j % 16 (high nibble from j = 16 on), its fifth bit as
    bit j of the 32-bit word at byte 2 (w = d (q - 16))."""
    packed = blocks[..., 6:22]
    low = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    word = blocks[..., 2:6].contiguous().view(torch.int32)  # [rows, blocks, 1]
    fifth = (word >> torch.arange(32, dtype=torch.int32)) & 1
    return low | (fifth.to(torch.uint8) << 4)


def widen_q5_0_to_q8_0(weight: QuantizedWeight) -> QuantizedWeight:
    """The same weights as Q8_0 blocks (d and q - 16 as int8): bit-identical once dequantized
    (both are one exact product d q), so a Q5_0 part can join a Q8_0 one in one kernel."""
    rows = weight.blocks.shape[0]
    blocks = weight.blocks.view(rows, weight.in_features // BLOCK, -1)
    q = (_q5_0_quants(blocks).to(torch.int16) - 16).to(torch.int8).view(torch.uint8)
    return QuantizedWeight(_T.Q8_0, torch.cat([blocks[..., 0:2], q], dim=-1).reshape(rows, -1))


def exact_repacked_weight(weight: GgufWeight) -> QuantizedWeight | None:
    """The weight as one type the exact repacked kernel takes, or None: a fused q/k/v whose
    parts are Q5_0 and Q8_0 (llama.cpp's Q4_K_M gives v a wider type) becomes Q8_0."""
    if isinstance(weight, QuantizedWeight):
        return weight if weight.kind in EXACT_KERNEL_KINDS else None
    kinds = {part.kind for part in weight.parts}
    if kinds <= {_T.Q5_0, _T.Q8_0}:
        widened = [widen_q5_0_to_q8_0(p) if p.kind == _T.Q5_0 else p for p in weight.parts]
        return QuantizedWeight(_T.Q8_0, torch.cat([part.blocks for part in widened]))
    return None


def _by_panels(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(scales, mins or None, quants) of the weight by panel of 16 output columns and 32-row
    block: float16 [panels, blocks, 16] twice, then [panels, blocks, 32 (depth), 16 (column)]
    (uint8 0..15 for Q4_1, 0..31 for Q5_0, int8 for Q8_0). Padded columns get zero scales and
    mins: they come out 0."""
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
    if weight.kind == GGMLQuantizationType.Q5_0:
        return scales, None, by_panel(_q5_0_quants(blocks))
    return scales, None, by_panel(blocks[..., 2:34].contiguous().view(torch.int8))


def _records(*parts: torch.Tensor) -> torch.Tensor:
    """Each part [panels, blocks, ...] as bytes, joined into one record per (panel, block)."""
    panels, num_blocks = parts[0].shape[:2]
    return torch.cat(
        [part.contiguous().view(torch.uint8).reshape(panels, num_blocks, -1) for part in parts],
        dim=-1,
    )


def _panel_major(values: torch.Tensor) -> torch.Tensor:
    """[rows, *rest] -> [panels, *rest, 16]: each panel's 16 rows last, zero-padded."""
    rows = values.shape[0]
    panels = -(-rows // PANEL)
    values = torch.cat([values, values.new_zeros(panels * PANEL - rows, *values.shape[1:])])
    return values.view(panels, PANEL, *values.shape[1:]).movedim(1, -1).contiguous()


def _inverted_bit_bytes(bits: torch.Tensor) -> torch.Tensor:
    """[P, B, 32 depths, 16 columns] of 0/1 -> [P, B, 4, 16] uint8: for depths 8 g..8 g + 7,
    byte j holds 1 - column j's bit, depth 8 g + t at bit t (quantized_linear.cpp's Q5_0)."""
    panels, num_blocks = bits.shape[:2]
    inverted = (1 - bits.to(torch.int32)).view(panels, num_blocks, BLOCK // 8, 8, PANEL)
    shifts = torch.arange(8, dtype=torch.int32).view(8, 1)
    return (inverted << shifts).sum(-2).to(torch.uint8)


def _q6_k_by_panels(weight: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """Q6_K's (d, scales, q) by panel: float16 [P, B, 16], int8 [P, B, 16 (sub-block), 16],
    q uint8 [P, B, 256 (depth), 16 (column)] in [0, 63] (w = d scale (q - 32))."""
    rows, num_blocks = weight.blocks.shape[0], weight.in_features // 256
    blocks = weight.blocks.view(rows, num_blocks, 210)
    # Value 128 h + 32 g + j: nibble of ql byte 64 h + 32 (g % 2) + j (the high one for g >= 2),
    # high bits (qh byte 32 h + j) >> 2 g (gguf/quants.py's Q6_K).
    ql = blocks[..., :128].reshape(rows, num_blocks, 2, 2, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3)
    qh = blocks[..., 128:192].reshape(rows, num_blocks, 2, 1, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
    q = _panel_major((low | (high << 4)).reshape(rows, num_blocks, 256))  # [P, B, 256, 16]
    scales = _panel_major(blocks[..., 192:208].contiguous().view(torch.int8))  # [P, B, 16, 16]
    d = _panel_major(_float16(blocks[..., 208:210]))  # [P, B, 16]
    return d, scales, q


def pack_q6_k_weight(weight: QuantizedWeight) -> torch.Tensor:
    """Q6_K for the exact kernel (quantized_linear.cpp's Q6_KRecord): [panels, blocks of 256,
    record]; per record 16 float16 d, 16 x 16 int8 scales (sub-block, column), per depth 8
    bytes of nibble pairs, then per 4 depths 16 bytes of high bits (column j's in byte j)."""
    d, scales, q = _q6_k_by_panels(weight)
    panels, num_blocks = q.shape[:2]
    nibbles = q & 0x0F
    pairs = nibbles[..., :8] | (nibbles[..., 8:] << 4)
    high = (q >> 4).view(panels, num_blocks, 64, 4, PANEL)  # depth 4 i + t
    packed_high = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4)
    packed_high |= high[:, :, :, 3] << 6
    return _records(d, scales, pairs, packed_high)


def _q4_k_by_panels(weight: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """Q4_K's (d, dmin, scales, mins, q) by panel: float16 [P, B, 16] twice, uint8 [P, B, 8
    (sub-block), 16] twice, and q uint8 [P, B, 256 (depth), 16 (column)] in [0, 15]."""
    rows, num_blocks = weight.blocks.shape[0], weight.in_features // 256
    blocks = weight.blocks.view(rows, num_blocks, 144)
    # Value 64 c + 32 h + j: nibble h of byte 16 + 32 c + j; sub-block 2 c + h's 6-bit scale
    # and min from the 12 bytes at 4 (gguf/quants.py's Q4_K).
    qs = blocks[..., 16:144].reshape(rows, num_blocks, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(rows, num_blocks, 256)
    packed = blocks[..., 4:16]
    first, last = packed[..., 0:4], packed[..., 8:12]
    scales = torch.cat([first & 63, (last & 0x0F) | ((first >> 2) & 0x30)], dim=-1)
    mins = torch.cat([packed[..., 4:8] & 63, (last >> 4) | ((packed[..., 4:8] >> 2) & 0x30)], -1)
    return (
        _panel_major(_float16(blocks[..., 0:2])),
        _panel_major(_float16(blocks[..., 2:4])),
        _panel_major(scales),
        _panel_major(mins),
        _panel_major(q),
    )


def pack_q4_k_weight(weight: QuantizedWeight) -> torch.Tensor:
    """Q4_K for the exact kernel (quantized_linear.cpp's Q4_KRecord): [panels, blocks of 256,
    record]; per record 16 float16 d, 16 dmin, 8 x 16 scales and 8 x 16 mins (sub-block,
    column; uint8), then per depth 8 bytes of nibble pairs."""
    d, dmin, scales, mins, nibbles = _q4_k_by_panels(weight)
    return _records(d, dmin, scales, mins, nibbles[..., :8] | (nibbles[..., 8:] << 4))


def pack_q6_k_int8_weight(weight: QuantizedWeight) -> torch.Tensor:
    """Q6_K for the int8 kernel (int8_linear.cpp): d and scales as the exact record, then per
    32-deep block Q4_1's nibble lanes of the low 4 bits, and per half of 8 columns and nibble
    32 bytes holding vector i's high 2 bits at bits 2 i (3,360 bytes per 16 x 256)."""
    d, scales, q = _q6_k_by_panels(weight)
    panels, num_blocks = q.shape[:2]
    # [P, B, 8 blocks, 2 (depths 0-15, 16-31), 4 i, 4 t, 16 j] -> lanes (i, j, t)
    q = q.view(panels, num_blocks, 8, 2, 4, 4, PANEL).transpose(-1, -2)
    nibbles = (q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)  # [P, B, 8, 4, 16, 4]
    high = (q >> 4).reshape(panels, num_blocks, 8, 2, 4, 2, 8 * 4).to(torch.int32)
    shifts = (2 * torch.arange(4, dtype=torch.int32)).view(4, 1, 1)
    high = (high << shifts).sum(4).to(torch.uint8)  # [P, B, 8, 2 (nibble), 2 (half), 32]
    per_block = torch.cat(
        [
            nibbles.reshape(panels, num_blocks, 8, -1),
            high.transpose(3, 4).reshape(panels, num_blocks, 8, -1),
        ],
        dim=-1,
    )
    return _records(d, scales, per_block)


def pack_q4_k_int8_weight(weight: QuantizedWeight) -> torch.Tensor:
    """Q4_K for the int8 kernel (int8_linear.cpp): the exact record's d, dmin, scales and
    mins, then per 32-deep sub-block Q4_1's 4 x 64 bytes of nibble lanes (2,368 bytes)."""
    d, dmin, scales, mins, q = _q4_k_by_panels(weight)
    panels, num_blocks = q.shape[:2]
    # [P, B, 8 sub-blocks, 2 (depths 0-15, 16-31), 4 i, 4 t, 16 j] -> lanes (i, j, t)
    q = q.view(panels, num_blocks, 8, 2, 4, 4, PANEL).transpose(-1, -2)
    return _records(d, dmin, scales, mins, q[:, :, :, 0] | (q[:, :, :, 1] << 4))


def pack_quantized_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The exact kernel's layout: [panels, in_features / 32, record] uint8, one record per
    panel of 16 output columns and 32-row block (see pipellm/kernels/quantized_linear.cpp).
    Scales (and mins) stay float16, as in the file: the kernel widens them exactly (F16C)."""
    if weight.kind == GGMLQuantizationType.Q6_K:
        return pack_q6_k_weight(weight)
    if weight.kind == GGMLQuantizationType.Q4_K:
        return pack_q4_k_weight(weight)
    scales, mins, q = _by_panels(weight)
    if mins is not None:
        pairs = q[..., :8] | (q[..., 8:] << 4)  # byte j: column j low, column j + 8 high
        return _records(scales, mins, pairs)
    if weight.kind == GGMLQuantizationType.Q5_0:  # Q4_1's nibble pairs, then fifth bits
        low = q & 0x0F
        pairs = low[..., :8] | (low[..., 8:] << 4)
        return _records(scales, pairs, _inverted_bit_bytes(q >> 4))
    return _records(scales, q)


def pack_int8_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The int8 kernel's layout (pipellm/kernels/int8_linear.cpp): per record, 4
    consecutive depths of a column in each 32-bit lane, as vpdpbusd multiplies them."""
    if weight.kind == GGMLQuantizationType.Q4_K:
        return pack_q4_k_int8_weight(weight)
    if weight.kind == GGMLQuantizationType.Q6_K:
        return pack_q6_k_int8_weight(weight)
    scales, mins, q = _by_panels(weight)
    panels, num_blocks = q.shape[:2]

    def lanes(values: torch.Tensor, groups: int) -> torch.Tensor:
        """[P, B, 4 groups, 16 columns] -> [P, B, groups, 16 columns, 4 depths]."""
        return values.view(panels, num_blocks, groups, 4, PANEL).transpose(-1, -2)

    if mins is not None:  # depth 4 i + t in the low nibble, 16 + 4 i + t in the high
        nibbles = lanes(q[:, :, :16], 4) | (lanes(q[:, :, 16:], 4) << 4)
        return _records(scales, mins, nibbles)
    if weight.kind == GGMLQuantizationType.Q5_0:  # Q4_1's nibbles, then their fifth bits
        low, high = lanes(q[:, :, :16], 4), lanes(q[:, :, 16:], 4)  # [P, B, 4, 16, 4]
        nibbles = (low & 0x0F) | ((high & 0x0F) << 4)
        # [P, B, 4 (i), 2 (h: columns 0-7, 8-15), 2 (low, high nibble), 4 bytes, 8 bits]
        fifth = torch.stack([low >> 4, high >> 4], dim=3)  # [P, B, 4, 2, 16, 4]
        fifth = fifth.view(panels, num_blocks, 4, 2, 2, PANEL // 2 * 4).transpose(3, 4)
        bits = fifth.reshape(panels, num_blocks, 4, 2, 2, 4, 8).to(torch.int32)
        words = (bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)
        return _records(scales, nibbles, words)
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)  # vpdpbusd takes u8 weights
    return _records(scales, lanes(shifted, 8))


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W in GGUF types, for float32 x on the CPU."""

    def __init__(
        self,
        weight: GgufWeight,
        bias: torch.Tensor | None,
        level: str | None = None,
        int8_activations: bool = False,
    ) -> None:
        """level: the kernels' instruction-set level (default: the one chosen for this CPU).
        int8_activations: x rounded to int8 (per 32 values, per 256 for the K-quants) and
        integer dot products (`quantization="gguf_int8"`: faster, not bit-identical to
        float32); a part in a 16-bit float type keeps the exact path."""
        super().__init__()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.bias = bias
        self.kind = weight.kind
        self.int8_activations = int8_activations and has_int8_path(weight)
        kernels = ops(level)
        # Q4_1, Q8_0, Q5_0, Q4_K and Q6_K take their repacked kernels; everything else the
        # stored blocks.
        repacked = exact_repacked_weight(weight)
        self.repacked = repacked is not None
        if repacked is not None:
            weight = repacked
            self.kernel_kind = EXACT_KERNEL_KINDS[weight.kind]
            if self.int8_activations:
                self.packed_weight = pack_int8_weight(weight)
                self.linear_op = kernels.quantized_linear_int8
            else:
                self.packed_weight = pack_quantized_weight(weight)
                self.linear_op = kernels.quantized_linear
            self.weight_args: tuple[object, ...] = (self.packed_weight, self.kernel_kind)
        else:
            self.part_blocks = [part.blocks for part in weight.parts]
            self.part_types = [int(part.kind) for part in weight.parts]
            op = kernels.gguf_linear_int8 if self.int8_activations else kernels.gguf_linear
            self.linear_op = op
            self.weight_args = (self.part_blocks, self.part_types)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return on_rows(self.linear_op, x, *self.weight_args, self.bias, self.out_features)

    def extra_repr(self) -> str:
        int8 = ", int8 activations" if self.int8_activations else ""
        kind = self.kind if isinstance(self.kind, str) else self.kind.name
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}{int8}"


class GgufEmbedding(nn.Module):
    """The token embedding looked up on a GGUF matrix's stored rows: only the rows a batch
    needs are dequantized (bit-identical to `gguf`'s float32), so the table stays as small as
    in the file (Gemma 3's 262,144 x 640 Q8_0 table: 178 MB, not 671 MB). Where a tied lm_head
    repacks the same Q8_0 table for its kernel, the lookup reads the rows from that copy
    instead (share_head), so the stage holds the table once.

    `weight` is the meta-device parameter of the nn.Embedding it replaces: a tied lm_head
    takes it as a placeholder before it becomes a QuantizedLinear on the same blocks."""

    def __init__(
        self, weight: QuantizedWeight, meta_weight: nn.Parameter, level: str | None = None
    ):
        super().__init__()
        self.kind, self.rows, self.hidden = weight.kind, weight.out_features, weight.in_features
        # The stored rows (uint8 blocks), a buffer so a walk over the module's tensors counts
        # them; not persistent: they come from the GGUF file, never a state dict.
        self.table: torch.Tensor | None
        self.register_buffer("table", weight.blocks, persistent=False)
        self.weight = meta_weight
        self.embedding_op = ops(level).gguf_embedding
        self.panel_rows_op = ops(level).q8_0_panel_rows
        self.head: QuantizedLinear | None = None

    def share_head(self, head: nn.Module) -> bool:
        """Reads rows from `head`'s repacked weight and drops the stored table, if head is a
        repacked Q8_0 QuantizedLinear of the same table (a tied lm_head); returns whether."""
        shares = (
            isinstance(head, QuantizedLinear)
            and head.repacked
            and head.kind == self.kind == GGMLQuantizationType.Q8_0
            and (head.out_features, head.in_features) == (self.rows, self.hidden)
        )
        if shares:
            self.head, self.table = head, None
        return shares

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.embedding_op(token_ids, self.table, int(self.kind), self.hidden)
        return self._rows_from_head(token_ids)

    def _rows_from_head(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the head's repacked Q8_0 records (pack_quantized_weight or, with int8
        activations, pack_int8_weight), as `gguf` dequantizes them (panel_rows.cpp)."""
        head = self.head
        return self.panel_rows_op(token_ids, head.packed_weight, head.int8_activations, self.rows)

    def extra_repr(self) -> str:
        where = "stored rows" if self.table is not None else "the lm_head's records"
        return f"{self.rows}, {self.hidden}, {self.kind.name}, from {where}"
