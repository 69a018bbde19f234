"""Turns last-position logits into tokens: greedy, temperature, top-k, top-p, min-p, seeds."""

from __future__ import annotations

import torch

from pipellm.model.logits_rules import RowRules, apply_logits_rules
from pipellm.protocol import Logprobs
from pipellm.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies temperature and the top-k / top-p / min-p cut-offs to one row of logits."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the first over p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def _random_token(
    logits: torch.Tensor, params: SamplingParams, position: int, fallback: torch.Generator
) -> int:
    probs = _filter(logits, params).softmax(-1)
    generator = fallback
    if params.seed is not None:
        # Seeded per (seed, position): reproducible whatever the batch or preemptions.
        generator = torch.Generator().manual_seed(params.seed * 1_000_003 + position)
    # Exponential race = sampling from probs (the Gumbel-max trick in another form).
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    generator: torch.Generator,
    rules: list[RowRules | None] | None = None,
) -> tuple[list[int], list[Logprobs | None]]:
    """logits: [S, V] float32; one SamplingParams and output position per row; `rules` gives
    the rows with logits rules (penalties, logit_bias, ...) what they read. Logprobs are the
    raw model's, as vLLM reports by default."""
    processed = apply_logits_rules(logits, rules) if rules else logits
    tokens = processed.argmax(-1).tolist()  # greedy rows are done here, in one call
    for row, p in enumerate(params):
        if not p.greedy:
            tokens[row] = _random_token(processed[row], p, positions[row], generator)
    logprobs: list[Logprobs | None] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        all_logprobs = logits[wanted].log_softmax(-1)
        for i, row in enumerate(wanted):
            pairs: list[tuple[int, float]] = []
            if params[row].logprobs:
                top = all_logprobs[i].topk(params[row].logprobs)
                pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            logprobs[row] = (float(all_logprobs[i, tokens[row]]), pairs)
    return tokens, logprobs
