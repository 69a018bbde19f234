"""Pipeline stages as OS processes: one process per stage, P micro-batches in flight.

Data flow per micro-batch:
  engine --pickled SchedulerOutput (one pipe per stage)--> every stage
  stage i --hidden states (torch.distributed send/recv, gloo on CPU)--> stage i+1
  last stage --ModelOutput (its pipe)--> engine's reader thread --> the oldest pending future

Every stage receives the schedule up front, so a stage starts a micro-batch the moment the
previous stage's hidden states arrive, and sends its own output without waiting for the next
stage to be ready (isend). The engine never waits on a stage except through a future.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait

from pipellm.config import EngineConfig
from pipellm.executor.base import WorkerDiedError
from pipellm.executor.pending import PendingOutputs
from pipellm.executor.remote import RemoteStagesExecutor
from pipellm.executor.stage_channel import send_schedule, serve_schedules
from pipellm.protocol import ModelOutput, SchedulerOutput, StageFailed, StageReady, one_line
from pipellm.worker.net import LOOPBACK, free_port
from pipellm.worker.stage_memory import LoadedStage, host_limit, log_host_memory

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0


class MultiprocExecutor(RemoteStagesExecutor):
    def __init__(self, config: EngineConfig) -> None:
        self.num_stages = config.pipeline_parallel_size
        # One process per tensor-parallel rank of each stage; rank 0 of the last stage samples.
        tp_size = config.tensor_parallel_size
        self.num_ranks = self.num_stages * tp_size
        self.output_rank = (self.num_stages - 1) * tp_size
        self._pending = PendingOutputs()
        self._closed = False
        port = free_port()
        self.processes, self.conns = spawn_with_pipes(
            stage_main,
            [(f"pipellm-stage-{rank}", (config, rank, port)) for rank in range(self.num_ranks)],
        )
        # Reap the stages even if the owner forgets to call shutdown().
        self._finalizer = weakref.finalize(self, reap, self.processes, self.conns)
        try:
            ready = wait_ready(
                self.processes,
                self.conns,
                lambda rank: f"pipeline stage {rank}",
                "pipeline stages did not start within the startup timeout",
            )
        except BaseException:
            self.shutdown()
            raise
        # What each stage holds, as it measured itself; all of them on this host.
        self.stage_memory: list[LoadedStage] = [message.memory for message in ready]
        for loaded in self.stage_memory:
            logger.info("%s", loaded.describe())
        planned = {loaded.name: loaded.planned for loaded in self.stage_memory}
        log_host_memory(socket.gethostname(), planned, host_limit())
        self._reader = threading.Thread(target=self._read_outputs, daemon=True)
        self._reader.start()

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        future = self._pending.add()
        if future.done():
            return future
        failed = send_schedule(self.conns, scheduler_output)
        if failed is not None:
            # A closed pipe means the stage is gone: name it and why, as the reader would once
            # it saw the process's sentinel (this send may simply come first).
            rank, error = failed
            self.processes[rank].join(timeout=1.0)  # the exit code is set on join
            reason = self._exit_reason(rank)
            if self.processes[rank].exitcode is None:
                reason = f"could not send a micro-batch to pipeline stage {rank}: {error}"
            self._pending.fail(reason)
        return future

    def _exit_reason(self, rank: int) -> str:
        process = self.processes[rank]
        return f"pipeline stage {rank} (pid {process.pid}) {exit_cause(process.exitcode)}"

    def _read_outputs(self) -> None:
        """Resolves futures in submission order; turns a dead or failed stage into errors."""
        last = self.conns[self.output_rank]
        watched = {p.sentinel: r for r, p in enumerate(self.processes)}
        watched.update({c: r for r, c in enumerate(self.conns)})
        while not self._closed:
            try:
                ready = wait(list(watched), timeout=1.0)
            except OSError:
                break
            for item in ready:
                rank = watched[item]
                if item is last:
                    try:
                        message = last.recv()
                    except (EOFError, OSError):
                        continue  # the sentinel tells why
                    if isinstance(message, ModelOutput):
                        self._pending.resolve_oldest(message)
                        continue
                    self._stage_failed(rank, message.traceback)
                elif isinstance(item, Connection):
                    try:
                        failed: StageFailed = item.recv()
                    except (EOFError, OSError):
                        continue
                    self._stage_failed(rank, failed.traceback)
                elif not self._closed:
                    self.processes[rank].join(timeout=1.0)  # the exit code is set on join
                    self._pending.fail(self._exit_reason(rank))
            if self._pending.dead:
                return

    def _stage_failed(self, rank: int, traceback_text: str) -> None:
        """Logs the stage's traceback; the reason that travels on (to /health, to clients)
        is its last line only."""
        logger.error("pipeline stage %d failed:\n%s", rank, traceback_text)
        reason = one_line(traceback_text, last=True)
        self._pending.fail(f"pipeline stage {rank} failed: {reason}", log=False)

    def check_health(self) -> None:
        self._raise_if_dead()
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise WorkerDiedError(f"pipeline stage {rank} is not running")


def spawn_with_pipes(
    target: Callable[..., None], jobs: list[tuple[str, tuple]]
) -> tuple[list[mp.process.BaseProcess], list[Connection]]:
    """Starts a spawned daemon process per (name, args) of `jobs`, running
    target(*args, its end of a new pipe, this process's pid); returns the processes and this
    side's pipe ends. If one fails to start, those already started are reaped."""
    context = mp.get_context("spawn")
    processes: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    try:
        for name, args in jobs:
            parent_conn, child_conn = context.Pipe()
            process = context.Process(
                target=target, args=(*args, child_conn, os.getpid()), name=name, daemon=True
            )
            conns.append(parent_conn)
            process.start()
            child_conn.close()
            processes.append(process)
    except BaseException:
        reap(processes, conns)
        raise
    return processes, conns


def wait_ready(
    processes: list[mp.process.BaseProcess],
    conns: list[Connection],
    label: Callable[[int], str],
    timeout_message: str,
) -> list[StageReady]:
    """Waits for every child's StageReady on its pipe, and returns them in the children's
    order; a startup error, an early exit or STARTUP_TIMEOUT_S raises WorkerDiedError at
    once, naming the child by `label(index)`."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = set(range(len(processes)))
    messages: dict[int, StageReady] = {}
    while waiting:
        watched = {conns[i]: i for i in waiting}
        watched.update({processes[i].sentinel: i for i in waiting})
        ready = wait(list(watched), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise WorkerDiedError(timeout_message)
        for item in ready:
            i = watched[item]
            if i not in waiting:
                continue
            if not conns[i].poll():
                raise WorkerDiedError(f"{label(i)} exited while starting")
            message: StageReady | StageFailed = conns[i].recv()
            if isinstance(message, StageFailed):
                raise WorkerDiedError(f"{label(i)} failed to start:\n{message.traceback}")
            messages[i] = message
            waiting.discard(i)
    return [messages[i] for i in range(len(processes))]


def join_or_kill(processes: list[mp.process.BaseProcess], timeout_s: float) -> None:
    """Waits up to timeout_s for each process to exit, then kills whichever is still alive:
    nothing started here outlives its caller."""
    for process in processes:
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.kill()
            process.join()


def reap(processes: list[mp.process.BaseProcess], conns: list[Connection]) -> None:
    """Asks every child to stop (None on its pipe), then makes sure: terminate, then kill."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=2.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


# ---- inside a stage process -----------------------------------------------------------------


def exit_with_parent(parent_pid: int) -> None:
    """A stage blocked in recv would never notice its engine is gone: poll and leave."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def stage_main(
    config: EngineConfig, rank: int, port: int, conn: Connection, parent_pid: int
) -> None:
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        from pipellm.worker.pipeline_stage import PipelineStage
        from pipellm.worker.process_group import Rendezvous

        # Each stage checks its own memory before loading (the host's stages start at once).
        stage = PipelineStage(config, rank, Rendezvous(LOOPBACK, port), None, socket.gethostname())
        conn.send(StageReady(stage.worker.memory))
    except BaseException:
        conn.send(StageFailed(traceback.format_exc()))
        return
    try:
        serve_schedules(stage, conn)
        stage.close()
    except BaseException:
        try:
            conn.send(StageFailed(traceback.format_exc()))
        finally:
            os._exit(1)  # peers may be blocked on this stage; the engine reaps them all


def exit_cause(code: int | None) -> str:
    """Why a stage process ended, in words: a signal's name, or what a plain exit means here."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == 0:
        # A stage exits cleanly only when told to, or when its engine or a neighbouring stage
        # went away first (its pipe or its process group closed): it is not the cause.
        return "exited on its own (exit code 0): its engine or a neighbouring stage stopped first"
    return f"exited with code {code}"
