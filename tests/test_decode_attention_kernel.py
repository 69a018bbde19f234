"""pipellm's paged decode attention kernel against a plain PyTorch reference."""

import math

import pytest
import torch

import pipellm.model.attention as attention
from pipellm.kernels.cpu_kernels import (
    DECODE_ATTENTION_HEAD_DIMS,
    cpu_kernels_available,
    why_unavailable,
)
from pipellm.model.forward_batch import ForwardBatch, PrefillChunk


def test_kernels_build_where_they_can():
    # A broken build must fail here, not silently fall back everywhere else.
    if why_unavailable() is None:
        assert cpu_kernels_available()


@pytest.fixture
def kernels():
    if why_unavailable() is not None:
        pytest.skip(f"CPU kernels unavailable here: {why_unavailable()}")
    assert cpu_kernels_available()


def random_paged_cache(lens, block_size, kv_heads, head_dim, seed=0):
    """Caches with every sequence's blocks scattered at random, and its padded block table."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(ids[used : used + n] + [0] * (width - n))
        used += n
    return k_cache, v_cache, torch.tensor(tables)


def reference(q, k_cache, v_cache, tables, lens, scale, starts=None, window=0):
    """Per sequence, in float64: softmax(q K^T * scale) V over its first len tokens (the last
    `window` of them if window > 0). `starts`: uneven runs of query heads per KV head (the
    kernels' group_starts)."""
    out = torch.empty_like(q)
    kv_heads = k_cache.shape[2]
    even = torch.full((kv_heads,), q.shape[1] // kv_heads)
    sizes = torch.tensor(starts).diff() if starts else even
    for s, n in enumerate(lens):
        keys = k_cache[tables[s]].flatten(0, 1)[:n].double()  # [n, Hkv, D]
        values = v_cache[tables[s]].flatten(0, 1)[:n].double()
        if window:
            keys, values = keys[-window:], values[-window:]
        keys, values = keys.repeat_interleave(sizes, 1), values.repeat_interleave(sizes, 1)
        scores = torch.einsum("hd,nhd->hn", q[s].double(), keys) * scale
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values).float()
    return out


@pytest.mark.parametrize("head_dim", sorted(DECODE_ATTENTION_HEAD_DIMS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_kernel_matches_reference(kernel_ops, head_dim, heads, kv_heads):
    lens = [1, 7, 16, 17, 64, 65, 130, 300]
    block_size = 16
    k_cache, v_cache, tables = random_paged_cache(lens, block_size, kv_heads, head_dim)
    # A query that is a strided view, as the model's split of its fused projection gives.
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim)
    q = qkv[:, :heads]
    scale = 1 / math.sqrt(head_dim)
    out = torch.empty(q.shape)
    kernel_ops.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.tensor(lens), scale)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, scale))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 20])
def test_float16_cache_reads_as_its_float32_widening(kernel_ops, head_dim, window):
    """A float16 cache (kv_cache_dtype="float16") gives the bits a float32 cache holding the
    same values gives: the kernel widens each value exactly, then computes as in float32."""
    lens = [1, 17, 64, 130]
    k_cache, v_cache, tables = random_paged_cache(lens, 16, 3, head_dim, seed=5)
    k_half, v_half = k_cache.half(), v_cache.half()
    q = torch.randn(len(lens), 9, head_dim)
    args = (tables, torch.tensor(lens), 0.125, None, window)
    out_half, out_float = torch.empty(q.shape), torch.empty(q.shape)
    kernel_ops.paged_decode_attention(out_half, q, k_half, v_half, *args)
    kernel_ops.paged_decode_attention(out_float, q, k_half.float(), v_half.float(), *args)
    assert torch.equal(out_half, out_float)
    expected = reference(q, k_half.float(), v_half.float(), tables, lens, 0.125, window=window)
    torch.testing.assert_close(out_half, expected)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        kernel_ops.paged_decode_attention(out_half, q, k_half, v_cache, *args)


@pytest.mark.parametrize("starts", [(0, 3, 5), (0, 2, 5), (0, 1, 4), (0, 2, 2, 5)])
def test_kernel_uneven_groups(kernel_ops, starts):
    """A tensor-parallel rank's heads: KV head h serves query heads [starts[h], starts[h+1])."""
    lens = [1, 17, 130]
    k_cache, v_cache, tables = random_paged_cache(lens, 16, len(starts) - 1, 64, seed=3)
    q, out = torch.randn(len(lens), starts[-1], 64), torch.empty(len(lens), starts[-1], 64)
    op = kernel_ops.paged_decode_attention
    op(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, list(starts))
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125, starts)
    torch.testing.assert_close(out, expected)
    with pytest.raises(RuntimeError, match="group_starts"):
        op(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, [0, 1, starts[-1] + 1])


@pytest.mark.parametrize("starts", [(0, 3, 6, 9), (0, 2, 2, 5)])
@pytest.mark.parametrize("window", [0, 20])
def test_tasks_by_sequence_or_by_kv_head_give_the_same_bits(kernel_ops, starts, window):
    """With at least twice as many sequences as threads a task is a whole sequence (all its KV
    heads in one pass over its blocks), else one KV head of one: the same sums either way."""
    lens = [1, 17, 64, 130, 5, 90]
    k_cache, v_cache, tables = random_paged_cache(lens, 16, len(starts) - 1, 64, seed=9)
    q = torch.randn(len(lens), starts[-1], 64)
    args = (tables, torch.tensor(lens), 0.125, list(starts), window)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, len(lens)):  # 6 sequences: whole on 1 thread, by KV head on 6
            torch.set_num_threads(n)
            out = torch.empty(q.shape)
            kernel_ops.paged_decode_attention(out, q, k_cache, v_cache, *args)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125, starts, window=window)
    torch.testing.assert_close(outs[0], expected)


@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_kernel_sliding_window(kernel_ops, window, head_dim):
    """A sliding-window layer reads the last `window` tokens only, whatever block they start
    in; contexts shorter than the window read all of theirs."""
    lens = [1, 7, 16, 17, 64, 130]
    k_cache, v_cache, tables = random_paged_cache(lens, 16, 2, head_dim, seed=4)
    q, out = torch.randn(len(lens), 4, head_dim), torch.empty(len(lens), 4, head_dim)
    op = kernel_ops.paged_decode_attention
    op(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.1, None, window)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.1, window=window)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_kernel_other_block_sizes(kernel_ops, block_size):
    lens = [3, 33, 100]
    k_cache, v_cache, tables = random_paged_cache(lens, block_size, 2, 64, seed=1)
    q = torch.randn(len(lens), 6, 64) * 4  # peaked softmax
    out = torch.empty(q.shape)
    kernel_ops.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, 0.125))


def test_kernel_rejects_what_would_read_out_of_bounds(kernel_ops):
    k_cache, v_cache, tables = random_paged_cache([20], 16, 2, 64)
    q, out = torch.randn(1, 4, 64), torch.empty(1, 4, 64)
    op = kernel_ops.paged_decode_attention
    with pytest.raises(RuntimeError, match="context length"):
        op(out, q, k_cache, v_cache, tables, torch.tensor([33]), 0.125)  # 2 blocks hold 32
    with pytest.raises(RuntimeError, match="block id"):
        op(out, q, k_cache, v_cache, tables + 1000, torch.tensor([20]), 0.125)
    k48, v48, _ = random_paged_cache([20], 16, 2, 48)
    with pytest.raises(RuntimeError, match="head_dim 48"):
        op(torch.empty(1, 4, 48), torch.randn(1, 4, 48), k48, v48, tables, torch.tensor([20]), 0.1)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(out, q, k_cache[:, :8], v_cache[:, :8], tables, torch.tensor([8]), 0.125)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("starts, window", [(None, 0), ((0, 3, 5), 0), (None, 20)])
def test_paged_attention_same_with_and_without_kernel(monkeypatch, starts, window):
    """A batch of decodes: the kernel path and the block gather + SDPA path agree, with even
    groups, with a tensor-parallel rank's uneven ones, and in a sliding-window layer."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    if starts is not None:
        heads, kv_heads = starts[-1], len(starts) - 1
    lens = [40, 5, 90]  # decodes' contexts, new token included
    k_cache, v_cache, tables = random_paged_cache(lens, block_size, kv_heads, head_dim, seed=2)
    slots = [
        int(tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size
        for s, n in enumerate(lens)
    ]
    mask = torch.arange(tables.shape[1] * block_size) < torch.tensor(lens).unsqueeze(1)
    batch = ForwardBatch(
        positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.tensor(slots),
        num_decodes=len(lens),
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(lens),
        decode_mask=mask.view(len(lens), 1, 1, -1),
        prefills=[],
        logits_indices=torch.arange(len(lens)),
    )
    q = torch.randn(len(lens), heads, head_dim)
    k, v = torch.randn(len(lens), kv_heads, head_dim), torch.randn(len(lens), kv_heads, head_dim)
    k_cache.view(-1, kv_heads, head_dim)[batch.slot_mapping] = k  # as rotate_and_cache does
    v_cache.view(-1, kv_heads, head_dim)[batch.slot_mapping] = v
    args = (q, k, v, k_cache, v_cache, batch, 0.125, starts, window)
    with_kernel = attention.paged_attention(*args)
    monkeypatch.setattr(attention, "kernels_apply", lambda x: False)
    without = attention.paged_attention(*args)
    torch.testing.assert_close(with_kernel, without)
    if window:
        expected = reference(q, k_cache, v_cache, tables, lens, 0.125, window=window)
        torch.testing.assert_close(without, expected)


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, caplog):
    from pipellm.kernels import cpu_kernels

    def broken_build(level):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(cpu_kernels, "why_unavailable", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_load", broken_build)
    cpu_kernels.cpu_kernels_available.cache_clear()
    try:
        assert not cpu_kernels.cpu_kernels_available()
        assert "compiler exploded" in caplog.text and "WARNING" in caplog.text.upper()
    finally:
        cpu_kernels.cpu_kernels_available.cache_clear()


@pytest.mark.usefixtures("kernels")
def test_uneven_groups_prompt_in_one_chunk_or_two(monkeypatch):
    """A tensor-parallel rank's uneven query runs (3 + 2 query heads on 2 KV heads) through the
    prompt paths: one fresh chunk (the kernel, and SDPA without it) and the same prompt's last
    16 tokens as a continued chunk reading the cache (SDPA with keys repeated per head)."""
    starts, block_size, length, split = (0, 3, 5), 16, 40, 24
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(length, 5, 64, generator=generator)
    k, v = (torch.randn(length, 2, 64, generator=generator) for _ in range(2))
    k_cache, v_cache = torch.zeros(3, block_size, 2, 64), torch.zeros(3, block_size, 2, 64)
    k_cache.view(-1, 2, 64)[:length], v_cache.view(-1, 2, 64)[:length] = k, v

    def batch(rows: int, chunk: PrefillChunk) -> ForwardBatch:
        return ForwardBatch(
            positions=torch.arange(length - rows, length),
            slot_mapping=torch.arange(length - rows, length),
            num_decodes=0,
            decode_block_tables=None,
            decode_context_lens=None,
            decode_mask=None,
            prefills=[chunk],
            logits_indices=torch.tensor([rows - 1]),
        )

    whole = batch(length, PrefillChunk(0, length, None, None))
    mask = torch.arange(length) <= torch.arange(split, length).unsqueeze(1)
    tail = batch(length - split, PrefillChunk(0, length - split, torch.tensor([0, 1, 2]), mask))
    kernel = attention.paged_attention(q, k, v, k_cache, v_cache, whole, 0.125, starts)
    continued = attention.paged_attention(
        q[split:], k[split:], v[split:], k_cache, v_cache, tail, 0.125, starts
    )
    torch.testing.assert_close(continued, kernel[split:])
    monkeypatch.setattr(attention, "kernels_apply", lambda x: False)
    sdpa = attention.paged_attention(q, k, v, k_cache, v_cache, whole, 0.125, starts)
    torch.testing.assert_close(sdpa, kernel)
