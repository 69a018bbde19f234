"""What a cost model needs to know: the shape of a micro-batch and of a model's layers.

Layer shapes come from any Hugging Face `config.json` (as a dict): standard multi-head or
grouped-query attention, DeepSeek's multi-head latent attention (MLA, `kv_lora_rank`), and
mixture-of-experts MLPs (DeepSeek's `n_routed_experts`, Mixtral's `num_local_experts`,
Qwen-MoE's `num_experts`), where each token runs `num_experts_per_tok` routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipellm.protocol import SchedulerOutput


@dataclass(frozen=True)
class BatchShape:
    """One micro-batch, as every stage sees it."""

    num_tokens: int
    num_requests: int
    num_sampled: int
    # Sum over the query tokens of the context each attends to (itself included): the
    # attention work, quadratic in a prefill chunk.
    attention_pairs: float
    # Sum over requests of the context after the chunk: the KV cache each layer reads.
    context_tokens: int

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput) -> BatchShape:
        pairs, context = 0.0, 0
        for r in scheduler_output.requests:
            n = r.num_scheduled_tokens
            pairs += n * (r.num_computed_tokens + (n + 1) / 2)
            context += r.num_computed_tokens + n
        return cls(
            num_tokens=scheduler_output.num_tokens,
            num_requests=len(scheduler_output.requests),
            num_sampled=scheduler_output.num_sampled,
            attention_pairs=pairs,
            context_tokens=context,
        )


@dataclass(frozen=True)
class LayerShape:
    """Parameters and attention sizes of one decoder layer."""

    dense_params: int  # used by every token: attention, router, shared experts, dense MLP
    expert_params: int  # one routed expert (0: no routed experts)
    num_experts: int
    experts_per_token: int
    attention_flops_per_pair: int  # per (query token, context token) pair
    kv_elements_per_token: int  # cached per token

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Distinct experts a micro-batch of `num_tokens` tokens needs, if routing is uniform:
        E (1 - (1 - k/E)^T). Their weights are what a step must read."""
        if not self.num_experts:
            return 0.0
        miss = (1 - self.experts_per_token / self.num_experts) ** num_tokens
        return self.num_experts * (1 - miss)


@dataclass(frozen=True)
class ModelShape:
    layers: list[LayerShape]
    hidden_size: int
    vocab_size: int

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size


def model_shape(cfg: dict[str, Any]) -> ModelShape:
    """Layer shapes from a Hugging Face config.json dict; raises ValueError naming a missing
    field."""
    try:
        hidden = cfg["hidden_size"]
        num_layers = cfg["num_hidden_layers"]
        attention, pair_flops, kv_elements = _attention(cfg)
        layers = []
        for index in range(num_layers):
            mlp, expert, num_experts, k = _mlp(cfg, index)
            layers.append(
                LayerShape(
                    dense_params=attention + mlp,
                    expert_params=expert,
                    num_experts=num_experts,
                    experts_per_token=k,
                    attention_flops_per_pair=pair_flops,
                    kv_elements_per_token=kv_elements,
                )
            )
        return ModelShape(layers, hidden, cfg["vocab_size"])
    except KeyError as missing:
        raise ValueError(f"the model config lacks the field {missing}") from None


def _attention(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(parameters, FLOPs per query-context pair, KV elements cached per token)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3)
        rope, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        lora, qk = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"] + cfg["qk_nope_head_dim"]
        q_lora = cfg.get("q_lora_rank")
        q = hidden * q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
        kv = hidden * (lora + rope) + lora * heads * (nope + v)
        # The cache holds the compressed latent and the shared rotary key only.
        return q + kv + heads * v * hidden, 2 * heads * (qk + v), lora + rope
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (cfg.get("num_key_value_heads") or heads) * head_dim
    return hidden * (q + 2 * kv) + q * hidden, 4 * q, 2 * kv


def _mlp(cfg: dict[str, Any], index: int) -> tuple[int, int, int, int]:
    """(dense parameters, one routed expert's parameters, routed experts, experts per token)."""
    hidden = cfg["hidden_size"]
    num_experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    num_experts = num_experts or cfg.get("num_experts") or 0
    dense_layer = (
        not num_experts
        or index < cfg.get("first_k_dense_replace", 0)
        or index % cfg.get("moe_layer_freq", cfg.get("decoder_sparse_step", 1)) != 0
        or index in cfg.get("mlp_only_layers", [])
    )
    if dense_layer:
        return 3 * hidden * cfg["intermediate_size"], 0, 0, 0
    expert_size = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("n_shared_experts", 0) * expert_size
    shared += cfg.get("shared_expert_intermediate_size", 0)
    router = hidden * num_experts
    return (
        3 * hidden * shared + router,
        3 * hidden * expert_size,
        num_experts,
        cfg["num_experts_per_tok"],
    )
