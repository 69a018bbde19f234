"""A stage's KV cache in one anonymous memory map, zero until first touched.

torch.zeros writes every byte of the cache before the first request (the default 1 GiB over
the stages: a fixed start-up cost of every engine, and all of it resident at once). Pages of a
private anonymous map are the kernel's zero page until written, so the cache starts zeroed,
as before, at no cost: a page becomes resident when a request's K/V first lands in it.
"""

from __future__ import annotations

import math
import mmap

import torch

_ALIGNMENT = 4096  # each tensor starts on its own page


def zeroed_kv_caches(
    shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A (K, V) pair of zero tensors of each shape, all views of one anonymous map (each keeps
    the map alive)."""
    sizes = [_aligned(math.prod(shape) * dtype.itemsize) for shape in shapes]
    memory = mmap.mmap(-1, max(2 * sum(sizes), _ALIGNMENT), flags=mmap.MAP_PRIVATE)
    caches, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        pair = []
        for _ in range(2):
            flat = torch.frombuffer(memory, dtype=dtype, count=math.prod(shape), offset=offset)
            pair.append(flat.view(shape))
            offset += size
        caches.append((pair[0], pair[1]))
    return caches


def _aligned(n_bytes: int) -> int:
    return -(-n_bytes // _ALIGNMENT) * _ALIGNMENT
