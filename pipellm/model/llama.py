"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3, SmolLM2) built for one
pipeline stage. The families differ by ModelConfig's named switches (model/model_config.py):
q/k norms, four norms a layer, the MLP's activation, the embedding's scale, sliding-window
layers with their own RoPE base.

A stage owns the layers [layer_start, layer_end); the first stage also owns the embedding,
the last the final norm and lm_head. Parameter names follow Hugging Face checkpoints, except
that q/k/v and gate/up are each one fused projection (one GEMM instead of three or two, ~10%
faster at decode sizes); `checkpoint_shards` says which checkpoint tensors make up a parameter.
"""

from __future__ import annotations

import zlib
from collections.abc import Container, Iterable

import torch
from torch import nn

from pipellm.model.attention import paged_attention, rotate_and_cache
from pipellm.model.decode_fast_path import DecodeFastPath, why_not_fused
from pipellm.model.forward_batch import ForwardBatch
from pipellm.model.fused_ops import (
    add_rms_norm_,
    argmax_rows,
    gelu_tanh_and_mul,
    head_rms_norm_,
    rms_norm,
    silu_and_mul,
)
from pipellm.model.gguf_linear import QuantizedWeight, stack_rows
from pipellm.model.linear import prepack_linears
from pipellm.model.model_config import ModelConfig
from pipellm.model.rope import RotaryEmbedding
from pipellm.model.stage_spec import StageSpec
from pipellm.model.tp_plan import TensorParallelPlan, plan_tensor_parallel
from pipellm.parallel.comm import TensorParallelComm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x += residual (in place), returns the norm of the sum."""
        return add_rms_norm_(x, residual, self.weight, self.eps)


class FusedLinear(nn.Linear):
    """Projections of the same input stacked into one weight, computed by one GEMM."""

    def __init__(self, in_features: int, shard_rows: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_rows), bias=bias)
        self.shard_rows = shard_rows


# The checkpoint projections each fused projection stacks, in order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def qkv_gather_index(config: ModelConfig, tp: TensorParallelPlan) -> torch.Tensor | None:
    """Where each row of this rank's heads' q/k/v sits in the all-gathered computed rows
    (model/tp_plan.py); None where each rank computes exactly its heads' rows."""
    if not tp.exchanges_qkv:
        return None
    plans = [plan_tensor_parallel(config, tp.size, r) for r in range(tp.size)]
    return torch.tensor(tp.qkv_gather_index(plans), dtype=torch.long)


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism): qkv_proj column-parallel,
    o_proj row-parallel, one all-reduce; where heads straddle the ranks, q/k/v by rows and an
    all-gather first (see model/tp_plan.py)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelPlan,
        comm: TensorParallelComm | None,
        gather_index: torch.Tensor | None = None,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = tp.num_heads
        self.num_kv_heads = tp.num_kv_heads
        self.group_starts = tp.kv_group_starts  # uneven query heads per KV head, or None
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = window  # > 0: a sliding-window layer
        norm = config.qk_norm
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if norm else None
        self.comm = comm
        self.gather_index = gather_index  # computed q/k/v rows -> this rank's heads' rows
        self.qkv_width = tp.qkv_width
        self.qkv_proj = FusedLinear(config.hidden_size, tp.computed_qkv_rows, config.attention_bias)
        # o_proj's input columns: a slice of the heads' outputs where they straddle ranks.
        self.o_offset, o_columns = tp.o_offset, tp.o_columns[1] - tp.o_columns[0]
        # The partial sums are added up by the all-reduce: rank 0 alone adds the bias.
        bias = config.attention_output_bias and tp.rank == 0
        self.o_proj = nn.Linear(o_columns, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.gather_index is not None:
            pad = self.qkv_width - qkv.shape[1]
            padded = nn.functional.pad(qkv, (0, pad)) if pad else qkv
            qkv = self.comm.all_gather_columns(padded, self.gather_index)
        qkv = qkv.view(t, -1, self.head_dim)
        if self.q_norm is not None:
            qkv = self._norm_query_and_key_heads(qkv)
        q, k, v = rotate_and_cache(
            qkv, cos_sin, *kv_cache, batch.slot_mapping, self.num_heads, self.num_kv_heads
        )
        out = paged_attention(q, k, v, *kv_cache, batch, self.scale, self.group_starts, self.window)
        out = out.view(t, -1)
        if out.shape[1] != self.o_proj.in_features:
            out = out[:, self.o_offset : self.o_offset + self.o_proj.in_features].contiguous()
        out = self.o_proj(out)
        return out if self.comm is None else self.comm.all_reduce_(out)

    def _norm_query_and_key_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, H + 2 Hkv, D] with each query head and key head RMS-normed (Qwen3, Gemma 3);
        in place where the kernel applies (qkv is this step's projection output)."""
        q_norm, k_norm = self.q_norm, self.k_norm
        return head_rms_norm_(
            qkv, q_norm.weight, k_norm.weight, self.num_heads, self.num_kv_heads, q_norm.eps
        )


class MLP(nn.Module):
    """This rank's MLP columns: gate_up_proj column-parallel, down_proj row-parallel."""

    def __init__(
        self, config: ModelConfig, tp: TensorParallelPlan, comm: TensorParallelComm | None
    ) -> None:
        super().__init__()
        size = tp.intermediate_size
        self.comm = comm
        self.gate_up_proj = FusedLinear(config.hidden_size, [size, size], bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        gelu = config.hidden_activation == "gelu_pytorch_tanh"
        self.act_and_mul = gelu_tanh_and_mul if gelu else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return out if self.comm is None else self.comm.all_reduce_(out)


class DecoderLayer(nn.Module):
    """Layer `layer` (its global index) of the model. With sandwich norms (Gemma 3) the
    attention and MLP outputs are normed before they join the residual stream, and
    post_attention_layernorm is the first of those, pre_feedforward_layernorm the MLP's input
    norm (Hugging Face's names); otherwise post_attention_layernorm is the MLP's input norm."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallelPlan,
        comm: TensorParallelComm | None,
        gather_index: torch.Tensor | None,
        layer: int,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, tp, comm, gather_index, config.layer_window(layer))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(hidden, eps) if sandwich else None
        self.mlp = MLP(config, tp, comm)
        self.uses_local_rope = config.uses_local_rope(layer)
        self.cache_group = config.layer_cache_group(layer)  # whose blocks its cache is in

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it): the next layer
        (or the stage's end) adds them, fused with the norm that follows the add. The sums
        are written into the attention and MLP outputs, never into the caller's tensors."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_and_norm(x, residual)
            residual = x
        out = self.self_attn(h, cos_sin, kv_cache, batch)
        if self.pre_feedforward_layernorm is None:
            h = self.post_attention_layernorm.add_and_norm(out, residual)
            return self.mlp(h), out
        out = self.post_attention_layernorm(out)
        h = self.pre_feedforward_layernorm.add_and_norm(out, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), out


class LlamaStage(nn.Module):
    """The part of the model one pipeline stage runs; with tensor parallelism, one rank's
    share of it (`tp`: its heads, MLP columns and vocabulary; `comm`: its group)."""

    def __init__(
        self,
        config: ModelConfig,
        stage: StageSpec,
        dtype: torch.dtype,
        tp: TensorParallelPlan | None = None,
        comm: TensorParallelComm | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        layer_start, layer_end = stage.layer_start, stage.layer_end
        is_first, is_last = stage.is_first, stage.is_last
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = is_first, is_last
        self.tp = tp = tp or plan_tensor_parallel(config, 1, 0)
        self.comm = comm if tp.size > 1 else None
        comm = self.comm
        hidden, vocab = config.hidden_size, tp.vocab_size
        # NOTE: built on the meta device: weights arrive from the loader (or the dummy
        # initializer) as ready tensors, so random init and a second copy are never paid for.
        gather_index = qkv_gather_index(config, tp) if comm is not None else None
        with torch.device("meta"):
            needs_embedding = is_first or (is_last and config.tie_word_embeddings)
            # An explicit (meta) weight skips nn.Embedding's normal_ init, whose meta kernel
            # imports torch's Python decompositions: 74 MB resident for nothing.
            self.embed_tokens = (
                nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden))
                if needs_embedding
                else None
            )
            self.layers = nn.ModuleList(
                DecoderLayer(config, tp, comm, gather_index, layer)
                for layer in range(layer_start, layer_end)
            )
            self.norm = RMSNorm(hidden, config.rms_norm_eps) if is_last else None
            self.lm_head = None
            if is_last and not config.tie_word_embeddings:
                self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.dtype = dtype
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
        )
        self.local_rope = None  # the sliding-window layers' own RoPE base (Gemma 3)
        if any(layer.uses_local_rope for layer in self.layers):
            self.local_rope = RotaryEmbedding(
                config.head_dim,
                config.max_position_embeddings,
                config.rope_local_theta,
                None,
                dtype,
            )
        self.decode_fast_path: DecodeFastPath | None = None  # see prepare_for_inference

    def forward(
        self,
        inputs: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, hidden states [T, hidden] after it."""
        x = self.embed(inputs) if self.is_first else inputs
        cos_sin = self.rope.tables(batch.positions)
        if self.decode_fast_path is not None and self.decode_fast_path.applies(batch):
            return self.decode_fast_path(x, cos_sin, kv_caches, batch)
        local = None if self.local_rope is None else self.local_rope.tables(batch.positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            tables = local if layer.uses_local_rope else cos_sin
            layer_batch = batch.for_group(layer.cache_group)
            x, residual = layer(x, residual, tables, kv_cache, layer_batch)
        return x if residual is None else x.add_(residual)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding; split by vocabulary, each rank looks up its own tokens (zeros for
        the others) and the all-reduce adds them up (vLLM's VocabParallelEmbedding). Scaled by
        embedding_scale where the family says (Gemma)."""
        scale = self.config.embedding_scale
        if self.comm is None:
            rows = self.embed_tokens(token_ids)
            return rows if scale == 1.0 else rows.mul_(scale)
        start, stop = self.tp.vocab
        mine = (token_ids >= start) & (token_ids < stop)
        rows = self.embed_tokens((token_ids - start) * mine)
        rows = self.comm.all_reduce_(rows.mul_(mine.unsqueeze(-1)))
        return rows if scale == 1.0 else rows.mul_(scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32: with tensor parallelism, each rank's vocabulary slice
        gathered, so every rank of the group holds all of them."""
        logits = self._vocab_slice_logits(hidden)
        return logits if self.comm is None else self.comm.all_gather(logits)

    def _vocab_slice_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, this rank's vocabulary slice] float32 (all of it without TP)."""
        return self.lm_head(self.norm(hidden)).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """argmax_rows(compute_logits(hidden)), the greedy tokens, without gathering the
        logits (with tensor parallelism): each rank takes its vocabulary slice's first maximum,
        the ranks exchange (value, token) pairs, and the first rank's wins a tie, as the first
        maximum of the whole row would. Each rank sends 8 bytes a row instead of its slice of
        the vocabulary (SmolLM2: 96 KiB a row), which is less to copy, though at one sequence
        the step time did not change measurably."""
        logits = self._vocab_slice_logits(hidden)
        best = argmax_rows(logits)
        if self.comm is None:
            return best.tolist()
        rows = torch.arange(len(best))
        # Token ids as float32 are exact below 2**24, far above any vocabulary.
        pairs = torch.stack([logits[rows, best], (best + self.tp.vocab[0]).float()], dim=-1)
        ranks = self.comm.all_gather(pairs).view(len(best), self.tp.size, 2)
        winner = argmax_rows(ranks[..., 0].contiguous())
        return ranks[rows, winner, 1].long().tolist()

    def prepare_for_inference(
        self,
        prepack: bool,
        quantized: dict[str, QuantizedWeight] | None = None,
        int8_activations: bool = False,
    ) -> None:
        """Ties lm_head to the embedding where the config says so, and, with `prepack`,
        reorders every linear weight for the CPU's GEMM (see model/linear.py), except the
        linears `quantized` gives GGUF weights for (by module name, see quantized_linears),
        which compute on those (model/gguf_linear.py; with `int8_activations`, on int8
        activations). A tied lm_head gets its own packed copy of the embedding: it is the
        largest GEMM. Where the layers allow, builds the fused decode path
        (model/decode_fast_path.py)."""
        if self.is_last and self.lm_head is None:
            hidden, vocab = self.config.hidden_size, self.tp.vocab_size
            self.lm_head = nn.Linear(hidden, vocab, bias=False, device="meta")
            if "lm_head" not in (quantized or {}):  # else it takes the embedding's GGUF bytes
                self.lm_head.weight = self.embed_tokens.weight
        if prepack:
            prepack_linears(self, quantized or {}, int8_activations=int8_activations)
            if why_not_fused(self) is None:
                self.decode_fast_path = DecodeFastPath(self)

    def quantized_linears(
        self, checkpoint_weights: dict[str, QuantizedWeight]
    ) -> dict[str, QuantizedWeight]:
        """Module name -> the weight of each linear layer whose checkpoint tensors (by Hugging
        Face name) are all in `checkpoint_weights`, stacked as the layer fuses them."""
        names = [name for name, module in self.named_modules() if isinstance(module, nn.Linear)]
        if self.is_last and self.lm_head is None:
            names.append("lm_head")  # tied: made in prepare_for_inference
        linears = {}
        for name in names:
            parts = [checkpoint_weights.get(shard) for shard, _ in self.weight_shards(name)]
            stacked = None if None in parts else stack_rows(parts)
            if stacked is not None:
                linears[name] = stacked
        return linears

    def weight_shards(self, module_name: str) -> list[tuple[str, int]]:
        """checkpoint_shards of a linear layer's weight; a tied lm_head's is the embedding."""
        if module_name == "lm_head" and self.config.tie_word_embeddings:
            return [("model.embed_tokens.weight", self.tp.vocab_size)]
        return self.checkpoint_shards(f"{module_name}.weight")

    # ---- weights ---------------------------------------------------------------------------

    def checkpoint_shards(self, local_name: str) -> list[tuple[str, int]]:
        """(Hugging Face checkpoint name, rows) of the tensors that, stacked along dim 0 in
        this order, make up a parameter of this module."""
        if not local_name.startswith("layers."):
            name = local_name if local_name.startswith("lm_head.") else f"model.{local_name}"
            return [(name, self.get_parameter(local_name).shape[0])]
        _, index, rest = local_name.split(".", 2)
        prefix = f"model.layers.{int(index) + self.layer_start}."
        module_name, _, kind = rest.rpartition(".")
        parts = FUSED_PROJECTIONS.get(module_name)
        if parts is None:
            return [(prefix + rest, self.get_parameter(local_name).shape[0])]
        rows = self.get_submodule(f"layers.{index}.{module_name}").shard_rows
        return [(f"{prefix}{part}.{kind}", n) for part, n in zip(parts, rows, strict=True)]

    def _set_parameter(self, local_name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = local_name.rpartition(".")
        module = self.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(tensor.to(self.dtype), requires_grad=False))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], skipped: Container[str] = ()
    ) -> None:
        """Takes checkpoint tensors as the parameters; every parameter must be provided, but
        those made only of `skipped` checkpoint tensors (taken quantized instead: they stay on
        the meta device until prepare_for_inference replaces their layers)."""
        shards = {n: self.checkpoint_shards(n) for n, _ in self.named_parameters()}
        shards = {
            n: parts for n, parts in shards.items() if not all(name in skipped for name, _ in parts)
        }
        wanted = {
            name: (local_name, index)
            for local_name, parts in shards.items()
            for index, (name, _) in enumerate(parts)
        }
        received: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            if name not in wanted:
                continue  # e.g. a tied lm_head stored anyway
            local_name, index = wanted[name]
            parts = received.setdefault(local_name, {})
            parts[index] = tensor
            if len(parts) < len(shards[local_name]):
                continue  # a fused parameter waits for all of its shards
            whole = torch.cat([parts[i] for i in range(len(parts))]) if len(parts) > 1 else tensor
            expected = self.get_parameter(local_name).shape
            if whole.shape != expected:
                raise ValueError(
                    f"weight {local_name} (from {[n for n, _ in shards[local_name]]}): checkpoint "
                    f"shape {tuple(whole.shape)} != model shape {tuple(expected)}"
                )
            self._set_parameter(local_name, whole)
            del received[local_name]
            for part_name, _ in shards[local_name]:
                del wanted[part_name]
        if wanted:
            raise ValueError(f"checkpoint lacks weights: {sorted(wanted)[:5]} ...")

    def init_dummy_weights(self, seed: int) -> None:
        """Seeded random weights, for performance work without a checkpoint.

        Each checkpoint tensor is seeded by its name, so any stage split gives the same model.
        """
        for local_name, param in list(self.named_parameters()):
            if local_name.endswith("norm.weight"):  # as loaded: norm_weight_offset added
                self._set_parameter(local_name, torch.ones(param.shape))
                continue
            parts = []
            for name, rows in self.checkpoint_shards(local_name):
                key = zlib.crc32(name.encode())
                generator = torch.Generator().manual_seed(seed * 1_000_003 + key)
                # Drawn whole, then this rank's part: any tensor-parallel size, same model.
                shape = [rows, *param.shape[1:]]
                shard = self.tp.weight_shard(name)
                if shard is not None:
                    shape[shard.dim] = shard.full
                part = torch.randn(shape, generator=generator) * 0.02
                if shard is not None:
                    part = part.narrow(shard.dim, shard.start, shard.stop - shard.start)
                parts.append(part)
            self._set_parameter(local_name, torch.cat(parts))
