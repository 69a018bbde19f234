"""A pipeline stage's tensor-parallel group and the communicator its collectives go through.

Ranks on one host (always so with the mp backend) use the shared-memory communicator
(parallel/shm_comm.py); ranks spread over hosts, or where the kernel cannot be built, gloo.
PIPELLM_TP_COMM=gloo or shm picks one, e.g. to compare them (benchmarks/tp_allreduce.py).
"""

from __future__ import annotations

import logging
import os
import socket

import torch.distributed as dist

from pipellm.parallel.comm import GlooComm, TensorParallelComm

logger = logging.getLogger(__name__)
COMM_ENV = "PIPELLM_TP_COMM"


def make_tensor_parallel_comm(
    num_stages: int, tp_size: int, stage: int
) -> TensorParallelComm | None:
    """Every rank of the default group calls this (new_group is collective over all ranks);
    returns this rank's stage's communicator, or None without tensor parallelism."""
    if tp_size == 1:
        return None
    groups = [
        dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(num_stages)
    ]
    ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
    group = groups[stage]
    wanted = os.environ.get(COMM_ENV, "auto")
    if wanted not in ("auto", "shm", "gloo"):
        raise ValueError(f"{COMM_ENV}={wanted!r}: use auto, shm or gloo")
    hosts: list[str | None] = [None] * tp_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    one_host = len(set(hosts)) == 1
    if wanted != "gloo" and one_host:
        from pipellm.parallel.shm_comm import ShmComm, shm_comm_available

        if shm_comm_available():
            return ShmComm.create(group, ranks, stage)
        if wanted == "shm":
            raise RuntimeError(f"{COMM_ENV}=shm: the shared-memory kernel could not be built")
    elif wanted == "shm":
        raise RuntimeError(f"{COMM_ENV}=shm: the stage's ranks are on several hosts {hosts}")
    logger.info("tensor-parallel group of stage %d: gloo", stage)
    return GlooComm(group, ranks)
