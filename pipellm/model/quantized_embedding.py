"""An embedding kept in a GGUF file's quantized bytes: only the looked-up rows are dequantized.

A float32 copy of the embedding is the largest tensor of a small model's first stage
(SmolLM2-135M: 113 MB against 28 MB as Q8_0) and of a large one's (Llama 3 8B: 2.1 GB). A
step looks up one row per token, so dequantizing those rows (with gguf's own dequantizer, the
same that made the float32 copy: the same numbers) costs little next to the step.
"""

from __future__ import annotations

import gguf
import torch
from torch import nn

from pipellm.model.gguf_linear import QuantizedWeight


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's lookup over a QuantizedWeight's rows (one row per token)."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.kind = weight.kind
        self.blocks = weight.blocks  # uint8 [vocab rows, bytes per row]
        self.embedding_dim = weight.in_features

    @property
    def num_embeddings(self) -> int:
        return self.blocks.shape[0]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[token_ids.reshape(-1)].numpy()
        values = gguf.quants.dequantize(rows, self.kind).reshape(-1, self.embedding_dim)
        return torch.from_numpy(values).view(*token_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.name}"
