"""Turns last-position logits into tokens: greedy, temperature, top-k, top-p, min-p, seeds."""

from __future__ import annotations

import hashlib
import logging

import torch

from pipellm.model.fused_ops import argmax_rows
from pipellm.model.logits_rules import RowRules, apply_logits_rules
from pipellm.protocol import Logprobs
from pipellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of one output position: (seed, position) hashed into 63 bits.

    Any integer the API accepts works (2**70, -1, ...): torch's manual_seed takes 64 bits at
    most, and arithmetic such as seed * K + position overflowed it and killed the stage.
    """
    seed_bytes = seed.to_bytes((seed.bit_length() + 8) // 8, "little", signed=True)
    digest = hashlib.blake2b(seed_bytes + position.to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


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
        generator = torch.Generator().manual_seed(position_seed(params.seed, position))
    # Exponential race = sampling from probs (the Gumbel-max trick in another form).
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    generator: torch.Generator,
    rules: list[RowRules | None] | None = None,
) -> tuple[list[int], list[Logprobs | None], dict[int, str]]:
    """logits: [S, V] float32; one SamplingParams and output position per row; `rules` gives
    the rows with logits rules (penalties, logit_bias, ...) what they read. Logprobs are the
    raw model's, as vLLM reports by default.

    Returns tokens, logprobs, and {row: error} for rows whose sampling raised: one request's
    failure must fail that request only, never the stage that serves every other one.
    """
    failed: dict[int, str] = {}
    processed = _apply_rules(logits, rules, failed) if rules else logits
    tokens = argmax_rows(processed).tolist()  # greedy rows are done here, in one call
    logprobs: list[Logprobs | None] = [None] * len(params)
    for row, p in enumerate(params):
        if row in failed:
            continue
        try:
            if not p.greedy:
                tokens[row] = _random_token(processed[row], p, positions[row], generator)
            if p.logprobs is not None:
                logprobs[row] = _logprobs(logits[row], tokens[row], p.logprobs)
        except Exception as error:
            logger.exception("sampling failed for one request (row %d of %d)", row, len(params))
            failed[row] = f"sampling failed: {type(error).__name__}"
    return tokens, logprobs, failed


def _logprobs(logits: torch.Tensor, token: int, num_top: int) -> Logprobs:
    """The sampled token's logprob and the top num_top (token, logprob) pairs."""
    row = logits.log_softmax(-1)
    pairs: list[tuple[int, float]] = []
    if num_top:
        top = row.topk(num_top)
        pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return float(row[token]), pairs


def _apply_rules(
    logits: torch.Tensor, rules: list[RowRules | None], failed: dict[int, str]
) -> torch.Tensor:
    """The logits rules of the whole batch at once; if that raises, row by row, so that only
    the rows whose rules raise fail (marked in `failed`, their raw logits kept)."""
    try:
        return apply_logits_rules(logits, rules)
    except Exception:
        logger.exception("logits rules failed for a micro-batch; retrying row by row")
    rows = []
    for row, rule in enumerate(rules):
        try:
            rows.append(apply_logits_rules(logits[row : row + 1], [rule]))
        except Exception as error:
            failed[row] = f"applying logits rules failed: {type(error).__name__}"
            rows.append(logits[row : row + 1])
    return torch.cat(rows)
