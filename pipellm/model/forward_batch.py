"""Per-step attention inputs, built once by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    """One request's prompt chunk: tokens [start, start + length) of the flattened batch."""

    start: int
    length: int
    num_computed_tokens: int  # tokens of this request already in the cache
    context_slots: torch.Tensor | None  # cache slots of all context_len keys, if any cached
    mask: torch.Tensor | None  # [length, context_len] bool, True = may attend


@dataclass
class ForwardBatch:
    """Tokens are ordered decodes first (one token each), then prefill chunks."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot written by each token
    num_decodes: int
    decode_slots: torch.Tensor | None  # [D, L] cache slots of each decode's keys (padded)
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] bool
    prefills: list[PrefillChunk]
    logits_indices: torch.Tensor  # [S] rows whose hidden state is sampled

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
