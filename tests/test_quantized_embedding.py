"""The embedding looked up in its GGUF rows gives the float32 embedding's rows, bit for bit."""

from __future__ import annotations

import gguf
import torch

from pipellm.loader.gguf_tensors import map_tensors
from pipellm.loader.source import resolve_model
from pipellm.model.gguf_linear import QuantizedWeight
from pipellm.model.quantized_embedding import QuantizedEmbedding


def test_looked_up_rows_equal_the_dequantized_embedding():
    tensor = next(t for t in map_tensors(resolve_model(None).path) if t.name == "token_embd.weight")
    blocks = torch.from_numpy(tensor.data.copy())
    embedding = QuantizedEmbedding(QuantizedWeight(tensor.tensor_type, blocks))
    token_ids = torch.tensor([[0, 5, 49151], [17, 17, 1000]])
    rows = embedding(token_ids)
    whole = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    assert rows.shape == (2, 3, whole.shape[1]) and rows.dtype == torch.float32
    assert torch.equal(rows, whole[token_ids])
