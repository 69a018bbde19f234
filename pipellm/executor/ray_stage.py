"""What runs inside each stage's Ray actor: the same PipelineStage and schedule loop the mp
backend runs, fed by its own channel from the engine (stage_channel.py), plus what a stage on
another host must settle first (can it open the model, where does it live)."""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Listener

from pipellm.config import EngineConfig
from pipellm.executor import stage_channel
from pipellm.loader.registry import find_preset
from pipellm.loader.source import ModelNotFoundError, resolve_model
from pipellm.protocol import StageFailed
from pipellm.worker.net import LOOPBACK, listening_socket
from pipellm.worker.stage_memory import HostLimit, StageMemory, host_limit, plan_stage_memory


@dataclass(frozen=True)
class StageLocation:
    """Where a stage runs, as the stage itself sees it."""

    address: str  # its Ray node's address
    node_id: str
    hostname: str
    pid: int
    netns: str  # the network namespace (Linux), so a test can tell hosts on one machine apart


def config_for_this_host(config: EngineConfig, address: str) -> EngineConfig:
    """The config with the model as this host has it; a clear error naming the host if not.

    A path must exist on every host. The built-in model is found again here, in this host's
    own installed package, which may live at another path than on the driver's host.
    """
    source = config.source
    if config.load_format == "dummy" or source.path.exists():
        return config
    if find_preset(source.name) is not None:
        try:
            config.source = resolve_model(source.name)
            return config
        except ModelNotFoundError as error:
            raise ModelNotFoundError(f"host {address} ({socket.gethostname()}): {error}") from None
    raise ModelNotFoundError(
        f"host {address} ({socket.gethostname()}) cannot open the model: {source.path} does not "
        "exist there. Every host of the cluster needs the model at the same path (or use the "
        "built-in model, installed on each host)"
    )


class StageActor:
    """One pipeline stage, or one tensor-parallel rank of it, as a Ray actor (made remote by
    the executor, with its resources and a `max_concurrency` of `run` plus spare threads for
    pings and clock reads): `run` serves the engine's channel for the actor's life."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        import ray

        self.config, self.rank = config, rank
        self.address = ray.util.get_node_ip_address()
        self.listener: socket.socket | None = None
        self.stage = None
        self.channel: Listener | None = None

    def locate(self) -> StageLocation:
        import ray

        self.config = config_for_this_host(self.config, self.address)
        return StageLocation(
            self.address,
            ray.get_runtime_context().get_node_id(),
            socket.gethostname(),
            os.getpid(),
            os.readlink("/proc/self/ns/net") if os.path.exists("/proc/self/ns/net") else "",
        )

    def plan_memory(self) -> tuple[StageMemory, HostLimit]:
        """What this stage will hold (its runtime measured now, before loading) and its host's
        memory limit as this process sees it."""
        stage, tp_rank = divmod(self.rank, self.config.tensor_parallel_size)
        return plan_stage_memory(self.config, stage, tp_rank), host_limit()

    def open_rendezvous(self, one_host: bool) -> tuple[str, int]:
        """The first stage listens on its host's address (loopback when all share one host)."""
        self.listener = listening_socket(LOOPBACK if one_host else self.address)
        return self.listener.getsockname()[:2]

    def start(self, host: str, port: int, one_host: bool) -> None:
        from pipellm.worker.pipeline_stage import PipelineStage
        from pipellm.worker.process_group import Rendezvous

        local = LOOPBACK if one_host else self.address
        rendezvous = Rendezvous(host, port, local)
        self.stage = PipelineStage(self.config, self.rank, rendezvous, self.listener)

    def lift_priority(self) -> int | None:
        """Undoes the nice value Ray starts its workers at; returns the value left where this
        process may not lower it (no CAP_SYS_NICE, RLIMIT_NICE too low), else None."""
        return normal_priority()

    def open_channel(self, authkey: bytes, near_engine: bool) -> tuple[str, int]:
        """Listens for the engine's channel: on loopback when the engine shares this host."""
        self.channel = stage_channel.listen(LOOPBACK if near_engine else self.address, authkey)
        return self.channel.address

    def run(self) -> None:
        """Accepts the engine's channel and runs its micro-batches until the engine sends
        None or closes it. A failure goes back on the channel first (the engine names this
        stage with it), then out of this call, whose Ray result also fails if the actor or its
        host dies."""
        import torch

        conn = stage_channel.accept(self.channel)
        try:
            # This thread computes: torch's intra-op thread count and (Linux) the nice value
            # are set per thread, and the threads it starts inherit both.
            normal_priority()
            torch.set_num_threads(self.config.threads_per_stage)
            stage_channel.serve_schedules(self.stage, conn)
        except EOFError:
            return  # the engine closed the channel: it is shutting down, or gone
        except BaseException:
            try:
                conn.send(StageFailed(traceback.format_exc()))
            except OSError:
                pass  # the engine is gone, or went first
            raise
        finally:
            conn.close()

    def clock(self) -> float:
        return time.time()

    def ping(self) -> bool:
        return True

    def tensor_parallel_comm(self) -> str | None:
        """Which communicator this rank's stage all-reduces over (ShmComm, GlooComm), if any."""
        comm = self.stage.comm if self.stage is not None else None
        return None if comm is None else type(comm).__name__


def normal_priority() -> int | None:
    """Sets every thread of this process to nice 0; returns the nice value left where that is
    not allowed, else None.

    Ray starts its workers at nice 15 (its `worker_niceness` setting), so that its own daemons
    come first; a stage at 15 also yields its core to every ordinary process of the host (an
    API server, a compiler), and a pipeline runs at its slowest stage's pace. On Linux the nice
    value belongs to each thread (setpriority(2)), so each one is set."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # not Linux: the process
    left = None
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError:
            left = os.getpriority(os.PRIO_PROCESS, tid)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    return left
