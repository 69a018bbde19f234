"""RoPE + cache writes: pipellm's one-pass kernel gives bit-identical q, k, v and caches to the
PyTorch ops (apply_rotary, index_copy_)."""

import pytest
import torch

from pipellm.kernels.cpu_kernels import cpu_kernels_available, why_unavailable
from pipellm.model import attention
from pipellm.model.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    why_unavailable() is not None, reason=f"CPU kernels unavailable: {why_unavailable()}"
)


def run(monkeypatch, use_kernel, qkv, cos_sin, caches, slots, heads, kv_heads):
    assert cpu_kernels_available()  # builds or loads them
    monkeypatch.setattr(attention, "kernels_apply", lambda x: use_kernel)
    qkv, caches = qkv.clone(), tuple(c.clone() for c in caches)
    q, k, v = attention.rotate_and_cache(qkv, cos_sin, *caches, slots, heads, kv_heads)
    return [t.clone() for t in (q, k, v, *caches)]


# SmolLM2's heads; a head_dim that is not a multiple of 8 (the scalar tail); 300 tokens: threads.
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,tokens",
    [(9, 3, 64, 1), (9, 3, 64, 300), (4, 4, 20, 7), (8, 2, 128, 16)],
)
def test_kernel_is_bit_identical_to_pytorch_ops(
    monkeypatch, heads, kv_heads, head_dim, tokens, cache_dtype
):
    generator = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.float32)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator)
    block_size, num_blocks = 16, 40
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = tuple(torch.randn(shape).to(cache_dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    args = (qkv, rope.tables(positions), caches, slots, heads, kv_heads)
    with_kernel = run(monkeypatch, True, *args)
    without = run(monkeypatch, False, *args)
    for got, expected in zip(with_kernel, without, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    k_cache = with_kernel[3].view(-1, kv_heads, head_dim)
    # The keys the step attends with are what is cached (rounded, for a float16 cache).
    assert with_kernel[1].dtype == torch.float32
    assert torch.equal(k_cache[slots].float(), with_kernel[1]), "the rotated keys are cached"
    v_cache = with_kernel[4].view(-1, kv_heads, head_dim)
    assert torch.equal(v_cache[slots].float(), with_kernel[2]), "the values are cached"
    if cache_dtype == torch.float16:
        fresh = qkv[:, heads + kv_heads :]
        assert not torch.equal(with_kernel[2], fresh), "values rounded to float16"
        assert torch.equal(with_kernel[2], fresh.half().float())
    assert not torch.equal(with_kernel[1], qkv[:, heads : heads + kv_heads]), "keys rotated"


def test_bad_slots_are_named(kernel_ops):
    qkv = torch.randn(2, 5, 8)
    cache = torch.zeros(2, 4, 1, 8)
    cos_sin = (torch.ones(2, 1, 8), torch.zeros(2, 1, 8))
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel_ops.rotary_and_cache_(
            qkv, *cos_sin, cache, cache.clone(), torch.tensor([0, 8]), 3, 1
        )
