"""Attention over the paged KV cache: one batched SDPA call for all decodes, one per prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipellm.model.forward_batch import ForwardBatch


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_slots, Hkv, D]. Returns [T, H, D].

    The new keys and values are written into their cache slots first; decodes then read
    their whole context with one padded gather, so no per-step concatenation is needed.
    """
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    nd = batch.num_decodes
    if nd:
        keys = k_cache[batch.decode_slots].transpose(1, 2)  # [D, Hkv, L, Dh]
        values = v_cache[batch.decode_slots].transpose(1, 2)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),
            keys,
            values,
            attn_mask=batch.decode_mask,
            scale=scale,
            enable_gqa=gqa,
        ).squeeze(2)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, len, Dh]
        if chunk.context_slots is None:  # nothing cached before: attend to the fresh keys
            keys, values, mask = k[rows], v[rows], None
        else:
            keys, values = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            mask = chunk.mask
        out[rows] = (
            F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return out
