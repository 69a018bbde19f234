"""How long a prompt chunk takes, from its prefix length and size: cost-balanced chunking.

A chunk of c new tokens after p cached ones costs, per layer, its linear layers (the same for
every token: 2 x layer parameters FLOPs each) plus attention (each new token attends to its
context, p + i + 1 for the i-th: 4 x q_dim FLOPs per context token). In units of one token's
linear layers:

    cost(p, c) = c * (1 + r * (p + (c + 1) / 2)),    r = attention_slowdown * 4 q_dim / (2 P_layer)

`attention_slowdown` is how much slower than the GEMMs the attention kernels run per FLOP on
the hardware: fitted by `benchmarks/prompt_chunk_times.py` (docs/pipeline.md has the fit and its
residuals), 1.0 for the sim backend, whose modelled stages run every FLOP at one rate. A
fixed per-step overhead is left out: it is the same for every micro-batch, so it does not
change which chunk sizes cost the same.

With `--pp-chunk-sizing cost` the scheduler sizes a prompt's chunks so that each costs what
the micro-batch's token budget costs at an empty prefix: later chunks of a long prompt shrink
and no stage waits on a heavier chunk. SGLang's dynamic chunking does the same with a fitted
quadratic (its chunked pipeline parallelism docs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipellm.model.model_config import ModelConfig

# Fitted on a 2-core AVX-512 Xeon, SmolLM2-135M with its GGUF weights, one thread, by
# benchmarks/prompt_chunk_times.py (docs/benchmarks.md): per FLOP the attention
# kernels ran a little faster than the quantized GEMMs (slowdown 0.73; fit residuals up to 18%).
CPU_ATTENTION_SLOWDOWN = 0.73


@dataclass(frozen=True)
class ChunkCostModel:
    attention_ratio: float  # r: one context token's attention cost / one token's linear layers

    @classmethod
    def for_model(cls, mc: ModelConfig, attention_slowdown: float) -> ChunkCostModel:
        q = mc.num_attention_heads * mc.head_dim
        kv = mc.num_key_value_heads * mc.head_dim
        layer_params = mc.hidden_size * (2 * q + 2 * kv) + 3 * mc.hidden_size * mc.intermediate_size
        return cls(attention_slowdown * 4 * q / (2 * layer_params))

    def cost(self, prefix: int, tokens: int) -> float:
        return tokens * (1 + self.attention_ratio * (prefix + (tokens + 1) / 2))

    def tokens_for(self, prefix: int, cost: float) -> int:
        """The most tokens after `prefix` whose chunk costs at most `cost` (0 if none fit)."""
        r = self.attention_ratio
        if r <= 0:
            return max(0, math.floor(cost + 1e-9))
        b = 1 + r * (prefix + 0.5)
        tokens = math.floor((-b + math.sqrt(b * b + 2 * r * cost)) / r + 1e-9)
        while tokens > 0 and self.cost(prefix, tokens) > cost * (1 + 1e-12):
            tokens -= 1
        return max(0, tokens)
