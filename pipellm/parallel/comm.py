"""The collectives a tensor-parallel stage needs: all-reduce (sum) and all-gather.

Each layer all-reduces twice, so on one host they go through shared memory
(pipellm/kernels/shm_comm.cpp, ~10 us for a decode step's [16, 576] float32) instead of gloo
(~1 ms: its TCP loopback round trips); across hosts gloo is the fallback. Every rank sums the
ranks' parts in rank order, so all ranks hold bit-identical results and never drift apart.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class TensorParallelComm(Protocol):
    size: int
    rank: int

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; returns x."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x concatenated along the last dimension, in rank order."""

    def all_gather_columns(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """all_gather(x)[:, index] for x [T, W] (the same W on every rank)."""

    def close(self) -> None: ...


class GlooComm:
    """torch.distributed over a process group (gloo on CPU): works across hosts."""

    def __init__(self, group: dist.ProcessGroup, ranks: list[int]) -> None:
        self.group = group
        self.size = len(ranks)
        self.rank = ranks.index(dist.get_rank())

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather_columns(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.all_gather(x).index_select(1, index)

    def close(self) -> None:
        pass
