"""How many tokens a balanced micro-batch may carry (`--pp-microbatch-tokens`, auto).

Small micro-batches fill and drain the pipeline quickly, but each one pays its stage's fixed
cost again: the step overhead and, where a step is bound by memory, reading the stage's
weights. On this project's CPU a 128-token step computes for ~0.25 s a stage, so the fixed
part is a few percent and 128 came out ahead of 256 and 512 (docs/pipeline.md). A GPU stage of
a mixture-of-experts model is another matter: 128 tokens touch nearly every expert, so each
128-token chunk re-reads the whole stage's weights, ~5x the chunk's compute. With a modelled
stage (the sim backend) the size comes from its cost: the fewest tokens, 128 doubled as often
as needed, whose step is at most FIXED_SHARE fixed cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipellm.config import EngineConfig

DEFAULT_MICROBATCH_TOKENS = 128
FIXED_SHARE = 0.2  # most of a micro-batch's step that its fixed cost may take


def microbatch_tokens(config: EngineConfig) -> int:
    """The setting, or its automatic value (module docstring)."""
    if config.pp_microbatch_tokens is not None:
        return config.pp_microbatch_tokens
    if config.distributed_executor_backend != "sim":
        return DEFAULT_MICROBATCH_TOKENS
    from pipellm.executor.sim import profile_for
    from pipellm.sim.shapes import BatchShape

    served = config.model_config.hf_config_kwargs()
    cost = profile_for(config).stage_costs(served, config.pipeline_parallel_size)[0]

    def seconds(tokens: int) -> float:
        # One prompt chunk, attention left out: the question is the fixed part of a step.
        return cost.seconds(BatchShape(tokens, 1, 0, float(tokens), tokens))

    largest = config.max_num_batched_tokens
    half = max(1, largest // 2)
    per_token = (seconds(largest) - seconds(half)) / (largest - half) if largest > half else 0.0
    if per_token <= 0:
        return DEFAULT_MICROBATCH_TOKENS  # steps that cost the same at any size: keep small
    tokens = DEFAULT_MICROBATCH_TOKENS
    while tokens < largest and seconds(tokens) * (1 - FIXED_SHARE) > tokens * per_token:
        tokens *= 2
    return min(tokens, largest)
