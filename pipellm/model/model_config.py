"""Architecture description of a Llama-family decoder, independent of where the weights live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to build a Llama/Mistral/Qwen2/Qwen3/Gemma 3/SmolLM2 decoder.

    Field names follow Hugging Face `config.json` so a reader can map them one to one. The
    families differ only by the switches after `eos_token_ids`; their defaults are Llama's.
    """

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"
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
    # The MLP's gate activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma).
    hidden_activation: str = "silu"
    # RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Norms on the attention and MLP outputs too, before each joins the residual stream, and
    # the MLP's input norm named pre_feedforward_layernorm (Gemma 3: four norms a layer).
    sandwich_norms: bool = False
    # Added to every norm weight a Hugging Face checkpoint stores: Gemma's norms compute
    # x * (1 + w) and store w; GGUF files store 1 + w already.
    norm_weight_offset: float = 0.0
    embedding_scale: float = 1.0  # the embedding's rows are multiplied by it (Gemma: sqrt(hidden))
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim's.
    query_pre_attn_scalar: float | None = None
    # Layers (global indices) that attend to the last `sliding_window` positions only, the
    # current one included, as transformers' and llama.cpp's masks count them.
    sliding_window: int = 0
    sliding_window_layers: tuple[int, ...] = ()
    # RoPE base of the sliding-window layers, without scaling (Gemma 3: 10,000); None: theirs
    # is rope_theta (and rope_scaling) like every other layer's.
    rope_local_theta: float | None = None

    def __post_init__(self) -> None:
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported; pipellm runs "
                f"{', '.join(ACTIVATIONS)}"
            )

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int:
        """The window of global layer `layer`: 0 where it attends to its whole context."""
        return self.sliding_window if layer in self.sliding_window_layers else 0

    @property
    def cache_group_windows(self) -> tuple[int, ...]:
        """The windows of the KV-cache groups (model/cache_groups.py), full attention (0)
        first: one group a distinct window."""
        return tuple(sorted({self.layer_window(i) for i in range(self.num_hidden_layers)}))

    def layer_cache_group(self, layer: int) -> int:
        """The KV-cache group of global layer `layer`: an index into cache_group_windows."""
        return self.cache_group_windows.index(self.layer_window(layer))

    def uses_local_rope(self, layer: int) -> bool:
        return self.rope_local_theta is not None and layer in self.sliding_window_layers

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
