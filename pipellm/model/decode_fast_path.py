"""A stage's decoder layers in one C++ call for batches of decodes only (the fused decode path).

At one sequence a decode step's layers spend ~40% of their time in Python glue (module calls,
the kernel wrappers' checks, views, a torch.ops dispatch per kernel) rather than in their
kernels (docs/performance.md, "The fused decode path").
DecodeLayers (pipellm/kernels/decode_layers.cpp) runs the same kernels in the same order with
the glue in C++, so its hidden states are bit-identical to the Python path's, which stays the
reference and serves everything else: prefills and mixed batches, and any layer the kernels do
not cover. PIPELLM_DECODE_FAST_PATH=0 turns it off, e.g. to compare.

With tensor parallelism every rank takes it too: DecodeLayers calls the shared-memory
all-reduce (parallel/shm_comm.cpp) where Attention and MLP call comm.all_reduce_ (and its
all-gather where Attention gathers the q/k/v rows of heads that straddle ranks), and passes
the rank's uneven query groups to the attention kernel. Over gloo (ranks on several hosts)
the all-reduce is torch.distributed's, out of C++'s reach: those ranks keep the Python path.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pipellm.kernels.cpu_kernels import (
    DECODE_ATTENTION_HEAD_DIMS,
    cpu_kernels_available,
    kernel_class,
    ops,
)
from pipellm.model.forward_batch import ForwardBatch
from pipellm.model.gguf_linear import QuantizedLinear
from pipellm.model.linear import PackedLinear
from pipellm.model.model_config import ModelConfig
from pipellm.parallel.shm_comm import ShmComm

FAST_PATH_ENV = "PIPELLM_DECODE_FAST_PATH"
# DecodeLayers' linear methods (decode_layers.cpp's Method).
_PACKED, _QUANTIZED, _QUANTIZED_INT8, _GGUF, _GGUF_INT8 = 0, 1, 2, 3, 4


def _method_and_kind(linear: nn.Module) -> tuple[int, int] | None:
    """How DecodeLayers computes this linear, as the Python path does; None if it can't."""
    kernels = ops()
    if isinstance(linear, PackedLinear) and linear.own_kernel:
        return (_PACKED, 0) if linear.linear_op is kernels.packed_linear else None
    if isinstance(linear, QuantizedLinear):
        # A layer built for another kernel level (tests compare levels) keeps the Python path.
        if linear.linear_op is kernels.quantized_linear:
            return _QUANTIZED, linear.kernel_kind
        if linear.int8_activations and linear.linear_op is kernels.quantized_linear_int8:
            return _QUANTIZED_INT8, linear.kernel_kind
        # The stored parts: `kind` is how many (DecodeLayers takes them from gguf_parts).
        if linear.linear_op is kernels.gguf_linear:
            return _GGUF, len(linear.part_blocks)
        if linear.int8_activations and linear.linear_op is kernels.gguf_linear_int8:
            return _GGUF_INT8, len(linear.part_blocks)
    return None


def _unfused_switch(config: ModelConfig) -> str | None:
    """The first family switch (model/model_config.py) DecodeLayers does not implement."""
    if config.qk_norm:
        return "q/k norms"
    if config.sandwich_norms:
        return "norms after attention and the MLP"
    if config.hidden_activation != "silu":
        return f"{config.hidden_activation} activation"
    if config.sliding_window_layers:
        return "sliding-window layers"
    return None


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
    switch = _unfused_switch(stage.config)
    if switch is not None:
        return f"DecodeLayers has no {switch}"
    for layer in stage.layers:
        linears = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        for linear in linears:
            if _method_and_kind(linear) is None:
                return f"a linear layer not on pipellm's kernels ({type(linear).__name__})"
    return None


class DecodeFastPath:
    """The stage's layers as one DecodeLayers object, built once from the prepared modules."""

    def __init__(self, stage: nn.Module) -> None:
        norms, weights, biases, methods, kinds, out_features = [], [], [], [], [], []
        gguf_parts, gguf_types = [], []
        no_bias = no_weight = torch.empty(0)
        for layer in stage.layers:
            norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            attention, mlp = layer.self_attn, layer.mlp
            for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
                method, kind = _method_and_kind(linear)
                if method in (_GGUF, _GGUF_INT8):
                    weights.append(no_weight)
                    gguf_parts += linear.part_blocks
                    gguf_types += linear.part_types
                else:
                    weights.append(linear.packed_weight)
                biases.append(no_bias if linear.bias is None else linear.bias.detach())
                methods.append(method)
                kinds.append(kind)
                out_features.append(linear.out_features)
        first = stage.layers[0].self_attn if len(stage.layers) else None
        # Every layer of a rank holds the same heads (model/tp_plan.py).
        group_starts = list(first.group_starts or ()) if first else []
        gathers = first is not None and first.gather_index is not None
        gather_index = first.gather_index if gathers else torch.empty(0, dtype=torch.long)
        o_columns = first.o_proj.in_features if first else 0
        sliced = first is not None and o_columns != first.num_heads * stage.config.head_dim
        o_slice = [first.o_offset, o_columns] if sliced else []
        self.comm = stage.comm  # kept: DecodeLayers holds its handle
        self.layers = kernel_class("DecodeLayers")(
            [norm.detach() for norm in norms],
            weights,
            biases,
            methods,
            kinds,
            out_features,
            first.num_heads if first else 0,
            first.num_kv_heads if first else 0,
            stage.config.head_dim,
            first.scale if first else 1.0,
            stage.config.rms_norm_eps,
            group_starts,
            stage.comm.handle if stage.comm is not None else 0,
            first.qkv_width if gathers else 0,
            gather_index,
            o_slice,
            gguf_parts,
            gguf_types,
        )
        self._bound: list[tuple[torch.Tensor, torch.Tensor]] | None = None

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
        cos, sin = cos_sin
        return self.layers.forward(
            x.contiguous(),
            cos,
            sin,
            batch.slot_mapping,
            batch.decode_block_tables,
            batch.decode_context_lens,
        )
