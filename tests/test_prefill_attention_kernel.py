"""pipellm's causal prefill attention kernel against SDPA."""

import pytest
import torch
import torch.nn.functional as F

from pipellm.kernels.cpu_kernels import cpu_kernels_available, why_unavailable


@pytest.fixture(autouse=True)
def kernels():
    if why_unavailable() is not None:
        pytest.skip(f"CPU kernels unavailable here: {why_unavailable()}")
    assert cpu_kernels_available()


def sdpa_causal(q, k, v, scale, window=0):
    """SDPA's causal attention; with `window`, each query sees its last `window` keys only."""

    def heads_first(x):
        return x.transpose(0, 1).unsqueeze(0)

    mask = None
    if window:
        offsets = torch.arange(len(q)).unsqueeze(1) - torch.arange(len(q))
        mask = (offsets >= 0) & (offsets < window)
    out = F.scaled_dot_product_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


# Lengths around the 64-query blocks and 16-key panels; GQA groups 1, 2, 3, 4.
@pytest.mark.parametrize("length", [1, 5, 16, 63, 64, 65, 130, 300])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 2, 128), (4, 4, 32)]
)
def test_prefill_kernel_matches_sdpa(kernel_ops, length, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(length)
    # Views into one fused projection output, as the model passes them.
    qkv = torch.randn(length, heads + 2 * kv_heads, head_dim, generator=generator) * 2
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    out = torch.empty(length, heads, head_dim)
    scale = head_dim**-0.5
    kernel_ops.prefill_attention(out, q, k, v, scale)
    torch.testing.assert_close(out, sdpa_causal(q, k, v, scale))


# Windows around the 16-key panels and 64-query blocks, shorter and longer than the prompt.
@pytest.mark.parametrize("window", [1, 8, 17, 64, 100, 1000])
@pytest.mark.parametrize("length", [5, 130, 300])
def test_prefill_kernel_sliding_window(kernel_ops, window, length):
    generator = torch.Generator().manual_seed(window)
    qkv = torch.randn(length, 4 + 2 * 2, 32, generator=generator) * 2
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    out = torch.empty(length, 4, 32)
    kernel_ops.prefill_attention(out, q, k, v, 0.2, None, window)
    torch.testing.assert_close(out, sdpa_causal(q, k, v, 0.2, window))


# A chunk that continues a prompt: its queries see every cached key (or, in a sliding-window
# layer, those within the window), then the chunk causally.
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("prefix, length", [(1, 1), (16, 5), (63, 64), (200, 65), (1000, 130)])
def test_prefill_kernel_with_cached_prefix_matches_masked_sdpa(kernel_ops, prefix, length, window):
    heads, kv_heads, head_dim = 9, 3, 64
    generator = torch.Generator().manual_seed(prefix)
    q = torch.randn(length, heads, head_dim, generator=generator) * 2
    k = torch.randn(prefix + length, kv_heads, head_dim, generator=generator) * 2
    v = torch.randn(prefix + length, kv_heads, head_dim, generator=generator)
    out = torch.empty(length, heads, head_dim)
    kernel_ops.prefill_attention(out, q, k, v, 0.125, None, window, prefix)
    offsets = torch.arange(prefix, prefix + length).unsqueeze(1) - torch.arange(prefix + length)
    mask = (offsets >= 0) & (offsets < (window or prefix + length))

    def heads_first(x):
        return x.transpose(0, 1).unsqueeze(0)

    expected = F.scaled_dot_product_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        attn_mask=mask,
        scale=0.125,
        enable_gqa=True,
    )
    torch.testing.assert_close(out, expected.squeeze(0).transpose(0, 1))
    with pytest.raises(RuntimeError, match="shapes"):
        kernel_ops.prefill_attention(out, q, k, v, 0.125, None, window, prefix + 1)


# The same chunk reading its context from a paged cache through a block table (the chunk's own
# keys already written there), as the model calls it: no gathered copy of the context.
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("prefix, length", [(1, 1), (16, 5), (63, 64), (200, 65), (1000, 130)])
def test_prefill_kernel_reads_paged_cache_through_block_table(kernel_ops, prefix, length, window):
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    generator = torch.Generator().manual_seed(prefix + 7)
    context = prefix + length
    needed = -(-context // block_size)
    num_blocks = needed + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator) * 2
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    # Blocks out of order, and one more in the table than the context needs (as a request's
    # table may hold): the kernel must follow the table, not the cache's order.
    table = torch.randperm(num_blocks, generator=generator)[: needed + 1]
    k = k_cache[table].reshape(-1, kv_heads, head_dim)[:context]
    v = v_cache[table].reshape(-1, kv_heads, head_dim)[:context]
    q = torch.randn(length, heads, head_dim, generator=generator) * 2
    expected = torch.empty(length, heads, head_dim)
    kernel_ops.prefill_attention(expected, q, k, v, 0.125, None, window, prefix)
    out = torch.empty(length, heads, head_dim)
    kernel_ops.prefill_attention(out, q, k_cache, v_cache, 0.125, None, window, prefix, table)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    offsets = torch.arange(prefix, context).unsqueeze(1) - torch.arange(context)
    mask = (offsets >= 0) & (offsets < (window or context))

    def heads_first(x):
        return x.transpose(0, 1).unsqueeze(0)

    sdpa = F.scaled_dot_product_attention(
        heads_first(q), heads_first(k), heads_first(v), attn_mask=mask, scale=0.125, enable_gqa=True
    )
    torch.testing.assert_close(out, sdpa.squeeze(0).transpose(0, 1))
    with pytest.raises(RuntimeError, match="block_table"):
        kernel_ops.prefill_attention(
            out, q, k_cache, v_cache, 0.125, None, window, prefix, table[: needed - 1]
        )
    with pytest.raises(RuntimeError, match="outside"):
        bad = table.clone()
        bad[0] = num_blocks
        kernel_ops.prefill_attention(out, q, k_cache, v_cache, 0.125, None, window, prefix, bad)


@pytest.mark.parametrize("window", [0, 50])
def test_prefill_kernel_reads_a_float16_cache_as_its_widening(kernel_ops, window):
    """A continued chunk over a float16 cache (kv_cache_dtype="float16") gets the bits the same
    values give as float32: the keys and values are widened exactly as they are packed."""
    heads, kv_heads, head_dim, block_size, prefix, length = 9, 3, 64, 16, 100, 40
    generator = torch.Generator().manual_seed(11)
    shape = (12, block_size, kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=generator) * 2).half()
    v_cache = torch.randn(shape, generator=generator).half()
    table = torch.randperm(12, generator=generator)[:9]
    q = torch.randn(length, heads, head_dim, generator=generator) * 2
    out, expected = torch.empty(length, heads, head_dim), torch.empty(length, heads, head_dim)
    args = (0.125, None, window, prefix, table)
    kernel_ops.prefill_attention(out, q, k_cache, v_cache, *args)
    kernel_ops.prefill_attention(expected, q, k_cache.float(), v_cache.float(), *args)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="float16"):
        kernel_ops.prefill_attention(out, q, k_cache, v_cache.float(), *args)


# A prompt cut into chunks (each after its cached prefix) gets the same bits in every row as the
# prompt computed whole: the reason greedy tokens do not depend on how the scheduler cuts
# prompts (balanced micro-batches or not). The cuts and lengths cross the kernel's 64-query
# blocks and its 256-key tiles.
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("cuts", [(128,), (300, 520), (256, 512, 640), (1, 700)])
def test_prefill_kernel_chunks_match_whole_prompt_bitwise(kernel_ops, cuts, window):
    heads, kv_heads, head_dim, length = 9, 3, 64, 777
    generator = torch.Generator().manual_seed(sum(cuts))
    q = torch.randn(length, heads, head_dim, generator=generator) * 2
    k = torch.randn(length, kv_heads, head_dim, generator=generator) * 2
    v = torch.randn(length, kv_heads, head_dim, generator=generator)
    whole = torch.empty(length, heads, head_dim)
    kernel_ops.prefill_attention(whole, q, k, v, 0.125, None, window)
    chunked = torch.empty(length, heads, head_dim)
    for start, end in zip((0, *cuts), (*cuts, length), strict=True):
        kernel_ops.prefill_attention(
            chunked[start:end], q[start:end], k[:end], v[:end], 0.125, None, window, start
        )
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)


def test_prefill_kernel_rejects_bad_shapes(kernel_ops):
    q, k = torch.randn(8, 4, 24), torch.randn(8, 2, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel_ops.prefill_attention(torch.empty(8, 4, 24), q, k, k, 0.2)
    q, k = torch.randn(8, 4, 32), torch.randn(7, 2, 32)
    with pytest.raises(RuntimeError, match="shapes"):
        kernel_ops.prefill_attention(torch.empty(8, 4, 32), q, k, k, 0.2)


# Uneven query heads per KV head, as a tensor-parallel rank holds them (SmolLM2's 9 query / 3
# KV heads over 2 ranks: query heads 0-4 on KV heads 0-1, query heads 4-8 on KV heads 1-2).
@pytest.mark.parametrize("starts", [(0, 3, 5), (0, 2, 5), (0, 1, 4), (0, 2, 2, 5)])
@pytest.mark.parametrize("length", [5, 64, 130])
def test_prefill_kernel_uneven_groups(kernel_ops, starts, length):
    heads, kv_heads, head_dim = starts[-1], len(starts) - 1, 64
    generator = torch.Generator().manual_seed(length)
    qkv = torch.randn(length, heads + 2 * kv_heads, head_dim, generator=generator) * 2
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    out = torch.empty(length, heads, head_dim)
    kernel_ops.prefill_attention(out, q, k, v, 0.125, list(starts))
    kv_of_head = torch.repeat_interleave(torch.arange(kv_heads), torch.tensor(starts).diff())
    expected = sdpa_causal(q, k[:, kv_of_head], v[:, kv_of_head], 0.125)
    torch.testing.assert_close(out, expected)
    with pytest.raises(RuntimeError, match="group_starts"):
        kernel_ops.prefill_attention(out, q, k, v, 0.125, [0, heads])
