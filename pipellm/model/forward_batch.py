"""Per-step attention inputs, built once by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunk:
    """One request's prompt chunk: rows [start, start + length) of the flattened batch."""

    start: int
    length: int
    # A chunk that continues a cached context (an earlier chunk, a prefix-cache hit) reads it
    # through its blocks; a chunk starting at position 0 attends to its own fresh keys only.
    block_table: torch.Tensor | None  # [num_blocks] blocks covering the whole context
    mask: torch.Tensor | None  # [length, context_len] bool, True = may attend


@dataclass
class ForwardBatch:
    """Tokens are ordered decodes first (one token each), then prefill chunks."""

    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] each decode's blocks, padded
    decode_context_lens: torch.Tensor | None  # [D] int64, tokens each decode attends to
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]
    logits_indices: torch.Tensor  # [S] rows whose hidden state is sampled
    # Per scheduled request, in the scheduler's order: the row of its chunk's last token.
    last_rows: list[int] = field(default_factory=list)
    # The same batch for each further KV-cache group (sliding-window layers, see
    # model/cache_groups.py): its own cache slots and block tables; empty with one group.
    group_batches: list[ForwardBatch] = field(default_factory=list)

    def for_group(self, group: int) -> ForwardBatch:
        """The batch as the layers of KV-cache group `group` see it."""
        return self if group == 0 else self.group_batches[group - 1]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
