"""A stage's decoder layers in one C++ call for batches of decodes only (the fused decode path).

At one sequence a decode step's layers spend ~40% of their time in Python glue (module calls,
the kernel wrappers' checks, views, a torch.ops dispatch per kernel) rather than in their
kernels (docs/performance.md, "The fused decode path").
DecodeLayers (pipellm/kernels/decode_layers.cpp) runs the same kernels in the same order with
the glue in C++, so its hidden states are bit-identical to the Python path's, which stays the
reference and serves everything else: prefills and mixed batches, and any layer the kernels do
not cover. Every family switch of model/model_config.py is covered: q/k norms, Gemma 3's four
norms a layer, the tanh-GELU gate, sliding-window layers with their own KV-cache group and
RoPE base. PIPELLM_DECODE_FAST_PATH=0 turns it off, e.g. to compare.

The weights reach C++ as one DecodeLayer per layer, a struct filled field by field by name
(its norms, a DecodeLinear per linear layer, its switches), added to the stage's DecodeLayers.

With tensor parallelism every rank takes it too: DecodeLayers calls the shared-memory
all-reduce (parallel/shm_comm.cpp) where Attention and MLP call comm.all_reduce_ (and its
all-gather where Attention gathers the q/k/v rows of heads that straddle ranks), and passes
the rank's uneven query groups to the attention kernel. Over gloo (ranks on several hosts)
the all-reduce is torch.distributed's, out of C++'s reach: those ranks keep the Python path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from pipellm.kernels.cpu_kernels import DECODE_ATTENTION_HEAD_DIMS, cpu_kernels_available, ops
from pipellm.kernels.kernel_ops import KernelOps
from pipellm.model.forward_batch import ForwardBatch
from pipellm.model.gguf_linear import QuantizedLinear
from pipellm.model.linear import PackedLinear
from pipellm.parallel.shm_comm import ShmComm

FAST_PATH_ENV = "PIPELLM_DECODE_FAST_PATH"
# DecodeLinear's methods (decode_layers.cpp's Method).
_PACKED, _QUANTIZED, _QUANTIZED_INT8, _GGUF, _GGUF_INT8 = 0, 1, 2, 3, 4


def _method(linear: nn.Module) -> int | None:
    """How DecodeLayers computes this linear, as the Python path does; None if it can't."""
    kernels = ops()
    # `==`, not `is`: each access to a method makes a new bound method.
    if isinstance(linear, PackedLinear) and linear.own_kernel:
        return _PACKED if linear.linear_op == kernels.packed_linear else None
    if isinstance(linear, QuantizedLinear):
        # A layer built for another kernel level (tests compare levels) keeps the Python path.
        if linear.linear_op == kernels.quantized_linear:
            return _QUANTIZED
        if linear.int8_activations and linear.linear_op == kernels.quantized_linear_int8:
            return _QUANTIZED_INT8
        if linear.linear_op == kernels.gguf_linear:
            return _GGUF
        if linear.int8_activations and linear.linear_op == kernels.gguf_linear_int8:
            return _GGUF_INT8
    return None


def _linears(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's linear layers, by DecodeLayer's field names."""
    attention, mlp = layer.self_attn, layer.mlp
    return {
        "qkv_proj": attention.qkv_proj,
        "o_proj": attention.o_proj,
        "gate_up_proj": mlp.gate_up_proj,
        "down_proj": mlp.down_proj,
    }


def why_not_fused(stage: nn.Module) -> str | None:
    """None if `stage` (a LlamaStage, after prepare_for_inference) can take the fused decode
    path, else why not."""
    if os.environ.get(FAST_PATH_ENV, "1") == "0":
        return f"turned off by {FAST_PATH_ENV}=0"
    if not cpu_kernels_available():
        return "pipellm's CPU kernels are not used"
    if stage.comm is not None and not isinstance(stage.comm, ShmComm):
        return f"tensor parallelism over {type(stage.comm).__name__}, not shared memory"
    if stage.dtype != torch.float32:
        return f"the kernels take float32, the model runs {stage.dtype}"
    if stage.config.head_dim not in DECODE_ATTENTION_HEAD_DIMS:
        return f"head_dim {stage.config.head_dim} has no decode attention kernel"
    for layer in stage.layers:
        for linear in _linears(layer).values():
            if _method(linear) is None:
                return f"a linear layer not on pipellm's kernels ({type(linear).__name__})"
    return None


def _decode_linear(kernels: KernelOps, linear: nn.Module) -> Any:
    """A DecodeLinear of `linear`'s weights, for the method the Python path uses."""
    method = _method(linear)
    fields = kernels.decode_linear()
    fields.method = method
    fields.out_features = linear.out_features
    fields.bias = None if linear.bias is None else linear.bias.detach()
    if method in (_GGUF, _GGUF_INT8):
        fields.parts = list(linear.part_blocks)
        fields.types = list(linear.part_types)
    else:
        fields.weight = linear.packed_weight
        fields.kind = 0 if method == _PACKED else linear.kernel_kind
    return fields


def _decode_layer(kernels: KernelOps, layer: nn.Module, gelu_tanh: bool) -> Any:
    """A DecodeLayer of a DecoderLayer (model/llama.py): its norms, linears and switches."""
    fields = kernels.decode_layer()
    norms = ("input_layernorm", "post_attention_layernorm")
    norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    for name in norms:
        norm = getattr(layer, name)
        if norm is not None:
            setattr(fields, name, norm.weight.detach())
    attention = layer.self_attn
    if attention.q_norm is not None:
        fields.q_norm = attention.q_norm.weight.detach()
        fields.k_norm = attention.k_norm.weight.detach()
    for name, linear in _linears(layer).items():
        setattr(fields, name, _decode_linear(kernels, linear))
    fields.gelu_tanh = gelu_tanh
    fields.window = attention.window
    fields.cache_group = layer.cache_group
    fields.local_rope = layer.uses_local_rope
    return fields


class DecodeFastPath:
    """The stage's layers as one DecodeLayers object, built once from the prepared modules."""

    def __init__(self, stage: nn.Module) -> None:
        kernels = ops()
        self.layers = kernels.decode_layers()
        self.comm = stage.comm  # kept: DecodeLayers holds its handle
        self.local_rope = stage.local_rope  # the window layers' RoPE, if theirs differs
        if len(stage.layers):
            self._set_attention(stage.layers[0].self_attn, stage)
        gelu_tanh = stage.config.hidden_activation == "gelu_pytorch_tanh"
        for layer in stage.layers:
            self.layers.add_layer(_decode_layer(kernels, layer, gelu_tanh))
        self._bound: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _set_attention(self, first: nn.Module, stage: nn.Module) -> None:
        """The attention geometry and tensor-parallel wiring, the same for every layer of a
        rank (model/tp_plan.py)."""
        layers = self.layers
        layers.num_heads, layers.num_kv_heads = first.num_heads, first.num_kv_heads
        layers.head_dim, layers.scale = stage.config.head_dim, first.scale
        layers.eps = stage.config.rms_norm_eps
        layers.group_starts = list(first.group_starts or ())
        layers.comm_handle = stage.comm.handle if stage.comm is not None else 0
        if first.gather_index is not None:
            layers.gather_index, layers.qkv_width = first.gather_index, first.qkv_width
        o_columns = first.o_proj.in_features
        if o_columns != first.num_heads * stage.config.head_dim:
            layers.o_slice = [first.o_offset, o_columns]

    @staticmethod
    def applies(batch: ForwardBatch) -> bool:
        """A batch of decodes only; any prefill chunk takes the Python path."""
        return not batch.prefills and 0 < batch.num_decodes == batch.num_tokens

    def __call__(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """The stage's output for hidden states x [T, hidden], as LlamaStage.forward's."""
        if kv_caches is not self._bound:  # the worker allocates its caches once, after load
            self.layers.set_caches([cache for pair in kv_caches for cache in pair])
            self._bound = kv_caches
        rope = list(cos_sin)
        if self.local_rope is not None:
            rope += self.local_rope.tables(batch.positions)
        groups = [batch, *batch.group_batches]
        return self.layers.forward(
            x.contiguous(),
            rope,
            [group.slot_mapping for group in groups],
            [group.decode_block_tables for group in groups],
            [group.decode_context_lens for group in groups],
        )
