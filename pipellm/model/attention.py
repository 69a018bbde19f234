"""Attention over the paged KV cache: one call for all decodes, one SDPA call per prefill;
and, before it, RoPE and the cache writes of the step's new keys and values.

A sliding-window layer (`window` > 0) lets each query see the last `window` positions only, its
own included, as transformers' and llama.cpp's masks do. Its KV-cache group keeps only the
blocks the window reaches (model/cache_groups.py): entries before the window may name the
null block or a block given back (since reused), which the decode kernel never reads and the
prompt paths read masked.

Each layer's cache is a pair of [num_blocks, block_size, kv_heads, head_dim] tensors, in the
model's dtype or, with `kv_cache_dtype="float16"`, in float16 (half the memory and the bytes a
decode streams; llama.cpp's default cache type): keys and values are then rounded once, as they
are written, and the step's own attention uses the rounded values too. Decodes
and continued prompt chunks use pipellm's own kernels, which read the cache in place through
the block tables (pipellm/kernels/), where they are built; otherwise reads copy whole blocks
(index_select on the block dimension): one contiguous block_size * kv_heads * head_dim run
per block, measured 3-5x faster than gathering token slots one by one.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pipellm.kernels.cpu_kernels import (
    DECODE_ATTENTION_HEAD_DIMS,
    KERNEL_CACHE_DTYPES,
    kernels_apply,
    ops,
)
from pipellm.model.forward_batch import ForwardBatch
from pipellm.model.rope import apply_rotary


def rotate_and_cache(
    qkv: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, H + 2 Hkv, D], the fused projection's output. Applies RoPE to the query and key
    heads, writes the keys and values into their cache slots, and returns q, k, v.

    pipellm's kernel does it in one pass, in place, with the same rounding as the PyTorch ops
    below (one rotary call for the query and key heads together: they share the positions).
    A cache of a narrower dtype gets k and v rounded to it, and so do the returned k and v.
    """
    sizes = [num_heads, num_kv_heads, num_kv_heads]
    if kernels_apply(qkv) and qkv.is_contiguous() and k_cache.dtype in KERNEL_CACHE_DTYPES:
        ops().rotary_and_cache_(
            qkv, *cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
        )
        return qkv.split(sizes, dim=1)
    q, k = apply_rotary(qkv[:, : num_heads + num_kv_heads], *cos_sin).split(sizes[:2], dim=1)
    v = qkv[:, num_heads + num_kv_heads :]
    if k_cache.dtype != k.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    head_dim = qkv.shape[-1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q, k.to(q.dtype), v.to(q.dtype)


def gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D]; block_tables: [..., n]. Returns
    [..., n * block_size, Hkv, D]: the keys (or values) of those blocks, in order, in `dtype`
    (default the cache's)."""
    num_blocks, block_size, num_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_tables.reshape(-1))
    return rows.view(*block_tables.shape[:-1], -1, num_heads, head_dim).to(dtype or cache.dtype)


@functools.cache
def kv_head_of_query(group_starts: tuple[int, ...]) -> torch.Tensor:
    """Each query head's KV head, from uneven group offsets (see TensorParallelPlan's
    kv_group_starts): (0, 3, 5) -> [0, 0, 0, 1, 1]. Cached (never written to): built per
    call it was four small tensor ops in every layer's attention, a visible share of a
    one-sequence tensor-parallel decode step."""
    sizes = torch.tensor(group_starts).diff()
    return torch.repeat_interleave(torch.arange(len(sizes)), sizes)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    group_starts: tuple[int, ...] | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D], already written into their cache slots (see
    rotate_and_cache), so decodes and continued prefills read their whole context from the
    cache without a concatenation. Returns [T, H, D]. `group_starts`: uneven runs of query
    heads per KV head (a tensor-parallel rank's, model/tp_plan.py); None: H / Hkv each.
    `window`: attend to the last `window` positions only (0: all of them).
    """
    num_heads = k.shape[1]
    out = q.new_empty(q.shape)  # contiguous, whatever q's strides
    gqa = q.shape[1] != num_heads
    # SDPA knows only even groups: with uneven ones its paths get the keys and values
    # repeated per query head (the kernels read them in place).
    starts = None if group_starts is None else list(group_starts)

    def per_query_head(x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if group_starts is None else x.index_select(dim, kv_head_of_query(group_starts))

    nd = batch.num_decodes
    cache_on_kernels = k_cache.dtype in KERNEL_CACHE_DTYPES
    if nd and q.shape[-1] in DECODE_ATTENTION_HEAD_DIMS and kernels_apply(q) and cache_on_kernels:
        ops().paged_decode_attention(
            out[:nd],
            q[:nd],
            k_cache,
            v_cache,
            batch.decode_block_tables,
            batch.decode_context_lens,
            scale,
            starts,
            window,
        )
    elif nd:
        tables = batch.decode_block_tables
        mask = batch.decode_mask
        if window:
            first = (batch.decode_context_lens - window).view(-1, 1, 1, 1)
            mask = mask & (torch.arange(mask.shape[-1]) >= first)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),  # [D, H, 1, Dh]
            per_query_head(gather_blocks(k_cache, tables, q.dtype).transpose(1, 2), 1),
            per_query_head(gather_blocks(v_cache, tables, q.dtype).transpose(1, 2), 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa and group_starts is None,
        ).squeeze(2)
    for chunk in batch.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        # The prompt kernel's GEMM step works on 16-wide panels of the head dimension. A chunk
        # that continues a prompt reads its cached context through its block table, in place:
        # gathering the whole context per chunk was an extra copy that grew with the prompt.
        paged = chunk.block_table is not None
        if q.shape[-1] % 16 == 0 and kernels_apply(q) and (not paged or cache_on_kernels):
            if not paged:
                ops().prefill_attention(out[rows], q[rows], k[rows], v[rows], scale, starts, window)
            else:
                prefix = chunk.mask.shape[1] - chunk.length
                ops().prefill_attention(
                    out[rows],
                    q[rows],
                    k_cache,
                    v_cache,
                    scale,
                    starts,
                    window,
                    prefix,
                    chunk.block_table,
                )
            continue
        if chunk.block_table is None:  # nothing cached before: attend to the fresh keys
            keys, values, mask = k[rows], v[rows], None
        else:
            context_len = chunk.mask.shape[1]
            keys = gather_blocks(k_cache, chunk.block_table, q.dtype)[:context_len]
            values = gather_blocks(v_cache, chunk.block_table, q.dtype)[:context_len]
            mask = chunk.mask
        if window:
            in_window = window_mask(chunk.length, keys.shape[0], window)
            mask = in_window if mask is None else mask & in_window
        # NOTE: 4-D inputs: SDPA's 3-D path with enable_gqa is about twice as slow on CPU.
        out[rows] = (
            F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),  # [1, H, len, Dh]
                per_query_head(keys, 1).transpose(0, 1).unsqueeze(0),
                per_query_head(values, 1).transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa and group_starts is None,
            )
            .squeeze(0)
            .transpose(0, 1)
        )
    return out


def window_mask(num_queries: int, context_len: int, window: int) -> torch.Tensor:
    """[num_queries, context_len] bool, True where a key is causal and within the last `window`
    positions of the query; the queries are the context's last num_queries positions."""
    query_positions = torch.arange(context_len - num_queries, context_len).unsqueeze(1)
    offsets = query_positions - torch.arange(context_len)
    return (offsets >= 0) & (offsets < window)
