"""The engine's channel to each stage: schedules in, the last stage's outputs back.

The mp backend's channel is a pipe; the Ray backend's is a TCP connection from the engine to
each stage, opened once at start-up, so a micro-batch's schedule and output never pass through
Ray's task machinery (its core worker threads and gRPC each way cost a lone decode token more
than a hop between hosts: docs/multinode.md). Ray still places, starts, pings and names the
stages. The connection is authenticated both ways with a random key that Ray hands each stage
(multiprocessing.connection's HMAC challenge), so nothing is unpickled from a peer that does
not hold the key, and it listens on one address only (the stage host's cluster address, or
loopback when the engine shares its host), never a wildcard.
"""

from __future__ import annotations

import pickle
import socket
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING

from pipellm.protocol import SchedulerOutput

if TYPE_CHECKING:  # the engine imports this module, and no torch
    from pipellm.worker.pipeline_stage import PipelineStage

_NOT_YET = object()  # the engine has not sent the next schedule yet


def serve_schedules(stage: PipelineStage, conn: Connection) -> None:
    """Runs each pickled SchedulerOutput from `conn` through `stage`, in order, sending back
    any output (the last stage's); returns when the engine sends None."""
    scheduler_output: SchedulerOutput | None = pickle.loads(conn.recv_bytes())
    while scheduler_output is not None:
        # The next schedule, if the engine sent it already: the stage receives its inputs
        # while it computes this one (PipelineStage._prefetch).
        following = pickle.loads(conn.recv_bytes()) if conn.poll() else _NOT_YET
        output = stage.step(scheduler_output, following if following is not _NOT_YET else None)
        if output is not None:
            conn.send(output)
        if following is _NOT_YET:
            following = pickle.loads(conn.recv_bytes())
        scheduler_output = following


def send_schedule(
    conns: list[Connection], scheduler_output: SchedulerOutput | None
) -> tuple[int, OSError] | None:
    """Sends one schedule (None: stop) to every stage, pickled once, in rank order; stops at the
    first stage whose channel is closed and returns its rank and the error, None if all took it.
    """
    payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
    for rank, conn in enumerate(conns):
        try:
            conn.send_bytes(payload)
        except OSError as error:
            return rank, error
    return None


def listen(host: str, authkey: bytes) -> Listener:
    """A listener for the engine's one connection, on `host` at a free port."""
    return Listener((host, 0), family="AF_INET", authkey=authkey)


def accept(listener: Listener) -> Connection:
    """The stage's end: waits for the engine, checks its key, and closes the listener."""
    with listener:
        return no_delay(listener.accept())


def connect(address: tuple[str, int], authkey: bytes) -> Connection:
    """The engine's end of a stage's channel (waits until the stage accepts)."""
    return no_delay(Client(address, family="AF_INET", authkey=authkey))


def no_delay(conn: Connection) -> Connection:
    """Sends each message at once (TCP_NODELAY): every schedule and output is waited for, and
    Nagle's algorithm would hold one back behind an unacknowledged predecessor."""
    with socket.socket(fileno=conn.fileno()) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.detach()
    return conn
