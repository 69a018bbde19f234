"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) built for one pipeline stage.

A stage owns the layers [layer_start, layer_end); the first stage also owns the embedding,
the last the final norm and lm_head. Parameter names follow Hugging Face checkpoints, so the
loader is a plain name-to-parameter copy.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pipellm.model.attention import paged_attention
from pipellm.model.forward_batch import ForwardBatch
from pipellm.model.model_config import ModelConfig
from pipellm.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_output_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = paged_attention(q, k, v, *kv_cache, batch, self.scale)
        return self.o_proj(out.view(t, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, kv_cache, batch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStage(nn.Module):
    """The part of the model one pipeline stage runs."""

    def __init__(
        self,
        config: ModelConfig,
        layer_start: int,
        layer_end: int,
        is_first: bool,
        is_last: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = is_first, is_last
        hidden, vocab = config.hidden_size, config.vocab_size
        # NOTE: built on the meta device: weights arrive from the loader (or the dummy
        # initializer) as ready tensors, so random init and a second copy are never paid for.
        with torch.device("meta"):
            needs_embedding = is_first or (is_last and config.tie_word_embeddings)
            self.embed_tokens = nn.Embedding(vocab, hidden) if needs_embedding else None
            self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(layer_start, layer_end))
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

    def forward(
        self,
        inputs: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, hidden states [T, hidden] after it."""
        x = self.embed_tokens(inputs) if self.is_first else inputs
        cos_sin = self.rope.tables(batch.positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        return F.linear(self.norm(hidden), head.weight).float()

    # ---- weights ---------------------------------------------------------------------------

    def checkpoint_name(self, local_name: str) -> str:
        """Maps a parameter name of this module to its Hugging Face checkpoint name."""
        if local_name.startswith("layers."):
            _, index, rest = local_name.split(".", 2)
            return f"model.layers.{int(index) + self.layer_start}.{rest}"
        if local_name.startswith("lm_head."):
            return local_name
        return f"model.{local_name}"

    def _set_parameter(self, local_name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = local_name.rpartition(".")
        module = self.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(tensor.to(self.dtype), requires_grad=False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes checkpoint tensors as the parameters; every parameter must be provided."""
        params = {self.checkpoint_name(n): (n, p.shape) for n, p in self.named_parameters()}
        missing = set(params)
        for name, tensor in weights:
            if name not in params:
                continue  # e.g. a tied lm_head stored anyway
            local_name, shape = params[name]
            if tensor.shape != shape:
                raise ValueError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)} "
                    f"!= model shape {tuple(shape)}"
                )
            self._set_parameter(local_name, tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]} ...")

    def init_dummy_weights(self, seed: int) -> None:
        """Seeded random weights, for performance work without a checkpoint.

        Each tensor is seeded by its checkpoint name, so any stage split gives the same model.
        """
        for name, param in list(self.named_parameters()):
            if name.endswith("norm.weight"):
                tensor = torch.ones(param.shape)
            else:
                key = zlib.crc32(self.checkpoint_name(name).encode())
                generator = torch.Generator().manual_seed(seed * 1_000_003 + key)
                tensor = torch.randn(param.shape, generator=generator) * 0.02
            self._set_parameter(name, tensor)
