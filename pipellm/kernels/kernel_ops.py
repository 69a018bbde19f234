"""Every op of pipellm's C++ kernel library, one method each with its signature: the one place
Python calls them.

The library registers each op once per instruction-set level, in that level's namespace
(torch.ops.pipellm_<level>, cpu_kernels.py); a KernelOps holds one level's. Each method takes
the op's arguments by the names its schema gives them (tests/test_kernel_ops.py checks that
every op registered has a method here with those parameters, in order) and calls the op. The
C++ declarations of the same ops are kernels/kernel_ops.h.

Get one from `cpu_kernels.ops(level)`: it builds or loads the level's library first.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


class KernelOps:
    """The ops of the kernel library built for one instruction-set level."""

    def __init__(self, level: str, namespace: Any, classes: Any) -> None:
        """namespace, classes: torch.ops.pipellm_<level> and torch.classes.pipellm_<level>."""
        self.level = level
        self._ops = namespace
        self._classes = classes

    def __repr__(self) -> str:
        return f"KernelOps({self.level!r})"

    # ---- linear layers (packed_linear.cpp, quantized_linear.cpp, int8_linear.cpp) ----------

    def pack_linear_weight(self, weight: Tensor) -> Tensor:
        """float32 [out_features, in_features] -> the layout packed_linear reads."""
        return self._ops.pack_linear_weight(weight)

    def packed_linear(
        self, x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int
    ) -> Tensor:
        """x [T, in] float32 times a pack_linear_weight weight, plus bias: [T, out_features]."""
        return self._ops.packed_linear(x, packed, bias, out_features)

    def quantized_linear(
        self, x: Tensor, packed: Tensor, kind: int, bias: Tensor | None, out_features: int
    ) -> Tensor:
        """x times a weight repacked for this kernel (model/gguf_linear.py's
        pack_quantized_weight), bit-identical to its float32 weights."""
        return self._ops.quantized_linear(x, packed, kind, bias, out_features)

    def quantized_linear_int8(
        self, x: Tensor, packed: Tensor, kind: int, bias: Tensor | None, out_features: int
    ) -> Tensor:
        """x rounded to int8 as llama.cpp rounds it for the weight's type (activation_rounding.h)
        times a pack_int8_weight weight."""
        return self._ops.quantized_linear_int8(x, packed, kind, bias, out_features)

    # ---- GGUF types as stored (gguf_linear.cpp, gguf_type_table.cpp) -----------------------

    def gguf_linear(
        self,
        x: Tensor,
        parts: list[Tensor],
        types: list[int],
        bias: Tensor | None,
        out_features: int,
    ) -> Tensor:
        """x times weight parts in GGUF types (uint8 blocks, stacked by rows)."""
        return self._ops.gguf_linear(x, parts, types, bias, out_features)

    def gguf_linear_int8(
        self,
        x: Tensor,
        parts: list[Tensor],
        types: list[int],
        bias: Tensor | None,
        out_features: int,
    ) -> Tensor:
        """gguf_linear with x rounded to int8 as llama.cpp rounds it for each part's type."""
        return self._ops.gguf_linear_int8(x, parts, types, bias, out_features)

    def gguf_embedding(self, ids: Tensor, blocks: Tensor, type: int, hidden: int) -> Tensor:
        """Rows `ids` of a GGUF matrix of `type` as float32 [*ids.shape, hidden]."""
        return self._ops.gguf_embedding(ids, blocks, type, hidden)

    def q8_0_panel_rows(self, ids: Tensor, packed: Tensor, int8_lanes: bool, rows: int) -> Tensor:
        """Rows `ids` of a Q8_0 matrix repacked into 16-row panels (pack_quantized_weight, or
        pack_int8_weight where int8_lanes) as float32 [*ids.shape, hidden] (panel_rows.cpp)."""
        return self._ops.q8_0_panel_rows(ids, packed, int8_lanes, rows)

    def gguf_kernel_types(self) -> list[int]:
        """Per GGUF type the kernels take: ggml type, block values, block bytes, int8 path."""
        return self._ops.gguf_kernel_types()

    # ---- attention (rotary_and_cache.cpp, paged_decode_attention.cpp, prefill_attention.cpp)

    def rotary_and_cache_(
        self,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        """RoPE on qkv's query and key heads in place; keys and values into their slots."""
        self._ops.rotary_and_cache_(
            qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads
        )

    def paged_decode_attention(
        self,
        out: Tensor,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
        scale: float,
        group_starts: list[int] | None = None,
        window: int = 0,
    ) -> None:
        """One query row a sequence against its cached context, into out [S, H, D]."""
        self._ops.paged_decode_attention(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            group_starts,
            window,
        )

    def prefill_attention(
        self,
        out: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float,
        group_starts: list[int] | None = None,
        window: int = 0,
        prefix: int = 0,
        block_table: Tensor | None = None,
    ) -> None:
        """Causal attention of a prompt chunk, into out; with block_table, k and v are the
        caches and the chunk continues `prefix` cached positions."""
        self._ops.prefill_attention(out, q, k, v, scale, group_starts, window, prefix, block_table)

    # ---- elementwise (elementwise.cpp) -----------------------------------------------------

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm_(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x += residual in place; returns rms_norm(x)."""
        return self._ops.add_rms_norm_(x, residual, weight, eps)

    def head_rms_norm_(
        self,
        qkv: Tensor,
        q_weight: Tensor,
        k_weight: Tensor,
        num_heads: int,
        num_kv_heads: int,
        eps: float,
    ) -> None:
        """qkv [T, H + 2 Hkv, D]: each query head normed with q_weight, each key head with
        k_weight, in place; the value heads untouched."""
        self._ops.head_rms_norm_(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps)

    def silu_and_mul(self, gate_up: Tensor) -> Tensor:
        return self._ops.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: Tensor) -> Tensor:
        """[T, 2 I] (gate, up) -> gelu(gate) * up with GELU's tanh approximation, [T, I]."""
        return self._ops.gelu_tanh_and_mul(gate_up)

    def argmax_rows(self, x: Tensor) -> Tensor:
        return self._ops.argmax_rows(x)

    # ---- a tensor-parallel group's shared memory (parallel/shm_comm.cpp) -------------------

    def shm_open_segment(self, name: str, create: bool, size: int, rank: int, capacity: int) -> int:
        """Maps (with create, first makes) a group's segment; returns its handle."""
        return self._ops.shm_open_segment(name, create, size, rank, capacity)

    def shm_close_segment(self, handle: int) -> None:
        self._ops.shm_close_segment(handle)

    def shm_unlink_segment(self, name: str) -> None:
        """Removes a segment's name; the mappings stay valid."""
        self._ops.shm_unlink_segment(name)

    def shm_all_reduce_(self, x: Tensor, handle: int) -> None:
        """Sums contiguous x over the ranks, in place."""
        self._ops.shm_all_reduce_(x, handle)

    def shm_all_gather(self, x: Tensor, out: Tensor, handle: int) -> None:
        """out[rank] = that rank's x."""
        self._ops.shm_all_gather(x, out, handle)

    def shm_all_gather_columns(self, x: Tensor, index: Tensor, out: Tensor, handle: int) -> None:
        """out[t, j] = column index[j] of the ranks' rows x [T, W] side by side."""
        self._ops.shm_all_gather_columns(x, index, out, handle)

    def shm_broadcast_send(self, data: Tensor, handle: int) -> None:
        """The root's uint8 data to every other rank; does not wait for them."""
        self._ops.shm_broadcast_send(data, handle)

    def shm_broadcast_recv(self, handle: int, root: int) -> Tensor:
        """The uint8 data rank `root` sent; raises, naming it, if the root died."""
        return self._ops.shm_broadcast_recv(handle, root)

    # ---- the fused decode path's classes (decode_layers.cpp) -------------------------------

    def decode_linear(self) -> Any:
        """An empty DecodeLinear: one linear layer's method and weights, set field by field."""
        return self._classes.DecodeLinear()

    def decode_layer(self) -> Any:
        """An empty DecodeLayer: one decoder layer's norms, linears and switches."""
        return self._classes.DecodeLayer()

    def decode_layers(self) -> Any:
        """An empty DecodeLayers: a stage's attention geometry and tensor-parallel wiring,
        then add_layer(DecodeLayer) per layer, set_caches, forward."""
        return self._classes.DecodeLayers()
