"""The shared-memory communicator of a tensor-parallel group whose ranks share a host.

The collectives are C++ (shm_comm.cpp, its header says how the lock-free handshake works),
built into pipellm's kernel library with the other kernels (pipellm/kernels/cpu_kernels.py:
`make install` builds it, per instruction-set level) and called through its op wrappers
(pipellm/kernels/kernel_ops.py). Where that library cannot be built (not x86-64 with AVX2, no
compiler) the group uses gloo. No segment outlives its group: rank 0 creates it under a name
holding its pid, every rank maps it, and rank 0 removes the name as soon as all have (a gloo
barrier), so the memory goes away with the last process, however it ends. A rank that dies
between creation and that barrier leaves a name behind: the next group on the host removes
names whose creator pid is gone.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from pipellm.kernels.kernel_ops import KernelOps

logger = logging.getLogger(__name__)

PREFIX = "pipellm-tp-"  # segment names: pipellm-tp-<creator pid>-<stage>-<random>
SHM_DIR = Path("/dev/shm")
# Bytes of one rank's slot (two per rank): a decode step's all-reduce ([16, 576] float32,
# 36 KiB) fits many times; a long prefill's goes through in chunks.
SLOT_BYTES = 1 << 20


@functools.cache
def shm_library() -> KernelOps | None:
    """The kernel library's ops at this CPU's level (built on first use, whether or not
    PIPELLM_CPU_KERNELS turns the compute kernels off), or None where it cannot be built."""
    from pipellm.kernels.cpu_kernels import chosen_level, ops, why_unbuildable

    reason = "not a POSIX system" if os.name != "posix" else why_unbuildable()
    if reason is not None:
        logger.warning("shared-memory all-reduce unavailable (%s); using gloo", reason)
        return None
    try:
        return ops(chosen_level())
    except Exception as error:  # a failed build: gloo instead
        logger.warning("shared-memory all-reduce unavailable (%s); using gloo", error)
        return None


def shm_comm_available() -> bool:
    return shm_library() is not None


def remove_stale_segments() -> list[str]:
    """Removes the segment names left by groups whose creating process is gone."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX) :].split("-")[0])
        except ValueError:
            continue
        if not psutil.pid_exists(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _as_uint8(data: bytes) -> torch.Tensor:
    """data as a uint8 tensor: a copy, since torch shares no read-only (bytes) buffer."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ShmComm:
    """all_reduce_, all_gather and a byte broadcast over one shared-memory segment per
    tensor-parallel group."""

    def __init__(self, handle: int, size: int, rank: int) -> None:
        self._lib = shm_library()
        self.handle, self.size, self.rank = handle, size, rank

    @classmethod
    def create(cls, group: dist.ProcessGroup, ranks: list[int], stage: int) -> ShmComm:
        """Collective over `group`: rank 0 makes the segment, all map it, rank 0 unlinks it."""
        lib = shm_library()
        size, rank = len(ranks), ranks.index(dist.get_rank())
        names = [None]
        if rank == 0:
            remove_stale_segments()
            names = [f"/{PREFIX}{os.getpid()}-{stage}-{secrets.token_hex(4)}"]
            handle = lib.shm_open_segment(names[0], True, size, rank, SLOT_BYTES)
        dist.broadcast_object_list(names, src=ranks[0], group=group)
        if rank != 0:
            handle = lib.shm_open_segment(names[0], False, size, rank, SLOT_BYTES)
        dist.barrier(group=group)
        if rank == 0:
            lib.shm_unlink_segment(
                names[0]
            )  # all mapped: the memory now lives exactly as long as they do
        return cls(handle, size, rank)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous():
            self._lib.shm_all_reduce_(x, self.handle)
            return x
        summed = x.contiguous()
        self._lib.shm_all_reduce_(summed, self.handle)
        return x.copy_(summed)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(self.size, *x.shape)
        self._lib.shm_all_gather(x, out, self.handle)
        # [size, ..., w] -> [..., size * w]: each row's parts side by side, in rank order.
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def all_gather_columns(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """all_gather(x)[:, index], without the gathered copy (x: [T, W], the same W on
        every rank)."""
        x = x.contiguous()
        out = x.new_empty(x.shape[0], index.numel())
        self._lib.shm_all_gather_columns(x, index, out, self.handle)
        return out

    def broadcast_send(self, data: bytes) -> None:
        """Sends `data` to every other rank (each calls broadcast_recv); does not wait."""
        self._lib.shm_broadcast_send(_as_uint8(data), self.handle)

    def broadcast_recv(self, root: int = 0) -> bytes:
        """The bytes rank `root` sent; raises RuntimeError, naming it, if the root died."""
        return self._lib.shm_broadcast_recv(self.handle, root).numpy().tobytes()

    def close(self) -> None:
        if self.handle:
            self._lib.shm_close_segment(self.handle)
            self.handle = 0
