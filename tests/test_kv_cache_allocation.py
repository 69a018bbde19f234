"""A stage's KV cache starts zeroed, each tensor its own memory, and holds no page until
written (the cache is one anonymous map)."""

from __future__ import annotations

import torch

from pipellm.worker.kv_cache_allocation import zeroed_kv_caches
from pipellm.worker.stage_memory import resident_bytes

MIB = 2**20


def test_caches_are_zero_separate_and_of_their_shapes() -> None:
    shapes = [(5, 16, 2, 64), (3, 16, 1, 80)]
    caches = zeroed_kv_caches(shapes, torch.bfloat16)
    tensors = [tensor for pair in caches for tensor in pair]
    assert [tuple(t.shape) for t in tensors] == [shapes[0], shapes[0], shapes[1], shapes[1]]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
    assert all(not t.any() for t in tensors)
    for index, tensor in enumerate(tensors):
        tensor.fill_(index + 1)
    for index, tensor in enumerate(tensors):  # no tensor overlaps another
        assert torch.equal(tensor, torch.full_like(tensor, index + 1))


def test_the_cache_is_resident_only_where_written() -> None:
    before = resident_bytes()
    caches = zeroed_kv_caches([(1024, 16, 4, 64)] * 4, torch.float32)  # 8 x 16 MiB
    allocated = resident_bytes()
    assert allocated - before < 8 * MIB
    caches[0][0].fill_(1.0)
    assert resident_bytes() - allocated >= 15 * MIB
    assert not caches[3][1].any()
