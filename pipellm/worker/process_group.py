"""How pipeline stages meet: one TCPStore on the first stage's address, then gloo (or NCCL).

The first stage hosts the store on a socket already listening on its own address (never a
wildcard), so nothing else on its network can claim the port first. Every stage binds gloo to
the interface that holds its own address: loopback on one host, the cluster address on several.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from pipellm.worker.net import LOOPBACK, interface_of

STORE_TIMEOUT = timedelta(seconds=300)  # how long a stage waits for the others to join


@dataclass(frozen=True)
class Rendezvous:
    """Where the stages meet (the first stage's store) and where this stage itself lives."""

    host: str
    port: int
    local_host: str = LOOPBACK


def join_pipeline_group(
    rendezvous: Rendezvous,
    rank: int,
    world_size: int,
    listener: socket.socket | None = None,
) -> tuple[dist.TCPStore, socket.socket | None]:
    """Initializes the default process group; the first stage passes (or gets) the listener.

    Returns the store and the listener: the caller keeps both alive as long as the group.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(rendezvous.local_host))
    if rank == 0:
        if listener is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((rendezvous.host, rendezvous.port))
            listener.listen()
        store = dist.TCPStore(
            rendezvous.host,
            rendezvous.port,
            world_size,
            is_master=True,
            timeout=STORE_TIMEOUT,
            master_listen_fd=listener.fileno(),
        )
    else:
        store = dist.TCPStore(
            rendezvous.host, rendezvous.port, world_size, is_master=False, timeout=STORE_TIMEOUT
        )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    return store, listener
