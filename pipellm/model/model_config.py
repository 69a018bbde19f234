"""Architecture description of a Llama-family decoder, independent of where the weights live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to build a Llama/Mistral/Qwen2/SmolLM2 decoder.

    Field names follow Hugging Face `config.json` so a reader can map them one to one.
    """

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections have a bias (Qwen2, some Llamas)
    attention_output_bias: bool = False  # o_proj has one too (Llama with attention_bias)
    # HF `rope_scaling` as the config states it (None = plain RoPE); see model/rope.py.
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def hf_config_kwargs(self) -> dict[str, Any]:
        """The architecture as Hugging Face config arguments (to build transformers' model of it,
        for comparisons)."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
        )
