"""Tensor parallelism without pipeline stages (T > 1, P = 1) on the mp backend: tensor-parallel
rank 0 runs in the engine's own process, ranks 1..T-1 in processes of their own.

vLLM's driver worker does the same (its rank 0 lives in the engine's process). The general mp
backend (executor/mp.py) gives every rank a process, so a decode step costs a third process on
the cores, the schedule pickled to T pipes, and the result's return through a pipe, a reader
thread and a future: a measurable share of a one-sequence decode step. Here rank 0 computes in
`submit`, as one process with threads would, and only the other ranks need the schedule. It
reaches them through the communicator's broadcast, not a pipe: a rank asleep in a pipe read
wakes a scheduler time slice after the write, late to the step's first all-reduce, which rank 0
then waits out; spinning on the segment it starts within microseconds (and sleeps once the
engine idles).

The ranks meet only through the shared-memory communicator (parallel/shm_comm.py): with one
stage there are no hidden states to pass, so no torch.distributed group at all. The engine's
process creates the segment, each rank maps it before it reports ready, and the name is
removed as soon as all have (or on any failure), so no segment outlives the group. A rank that
dies is found by the communicator's liveness check (~100 ms) while rank 0 waits for it at an
all-reduce, and named in the error.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch

from pipellm.config import EngineConfig
from pipellm.executor.base import Executor, WorkerDiedError
from pipellm.executor.mp import (
    exit_cause,
    exit_with_parent,
    reap,
    spawn_with_pipes,
    wait_ready,
)
from pipellm.protocol import ModelOutput, SchedulerOutput, StageFailed, StageReady, one_line


def driver_applies(config: EngineConfig) -> bool:
    """One stage, T > 1, mp, and the shared-memory all-reduce available (it needs no
    process group); PIPELLM_TP_COMM=gloo keeps the general backend, which has one."""
    if config.tensor_parallel_size == 1 or config.pipeline_parallel_size != 1:
        return False
    from pipellm.parallel.shm_comm import shm_comm_available
    from pipellm.parallel.tp_group import COMM_ENV

    return os.environ.get(COMM_ENV, "auto") != "gloo" and shm_comm_available()


class TensorParallelDriverExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        from pipellm.parallel.shm_comm import (
            PREFIX,
            SLOT_BYTES,
            ShmComm,
            remove_stale_segments,
            shm_library,
        )

        self.tp_size = config.tensor_parallel_size
        self.dead: str | None = None
        self._closed = False
        lib = shm_library()
        remove_stale_segments()
        name = f"/{PREFIX}{os.getpid()}-0-{secrets.token_hex(4)}"
        handle = lib.shm_open_segment(name, True, self.tp_size, 0, SLOT_BYTES)
        self.comm = ShmComm(handle, self.tp_size, 0)
        self.processes: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        try:
            self.processes, self.conns = spawn_with_pipes(
                rank_main,
                [
                    (f"pipellm-tp-rank-{tp_rank}", (config, tp_rank, name))
                    for tp_rank in range(1, self.tp_size)
                ],
            )
            # Until a step fails, the ranks wait for the next schedule: a clean stop reaches them.
            self._healthy = [True]
            self._finalizer = weakref.finalize(
                self, _reap, self.processes, self.conns, self.comm, self._healthy
            )
            # Rank 0 loads its share here while the other ranks load theirs.
            from pipellm.worker.worker import StageWorker

            torch.set_num_threads(config.threads_per_stage)
            self.worker = StageWorker(config, 0, 0, self.comm)
            wait_ready(
                self.processes,
                self.conns,
                self._rank_label,
                "tensor-parallel ranks did not start within the timeout",
            )
        except BaseException:
            self.shutdown()
            raise
        finally:
            lib.shm_unlink_segment(
                name
            )  # every rank mapped it, or failed: the name goes either way

    def _rank_label(self, index: int) -> str:
        process = self.processes[index]
        return f"tensor-parallel rank {index + 1} (pid {process.pid})"

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        future: Future[ModelOutput] = Future()
        if self.dead is not None:
            future.set_exception(WorkerDiedError(self.dead))
            return future
        try:
            self._healthy[0] = False  # until the step is done: the ranks may be mid-step
            self.comm.broadcast_send(
                pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
            )
            started = time.time()
            output = self.worker.execute(scheduler_output)
            output.stage_times = [(started, time.time())]
            self._healthy[0] = True
            future.set_result(output)
        except (OSError, RuntimeError) as error:
            # A peer gone (a closed pipe, or the all-reduce's liveness check) or failed: say
            # which rank and why; rank 0's own errors are re-raised as they are.
            reason = self._dead_peer_reason()
            if reason is None:
                # Rank 0's own error: the other ranks may wait at a collective it never
                # reached, so nothing more can run (shutdown kills them).
                self.dead = f"tensor-parallel rank 0 failed: {type(error).__name__}: {error}"
                future.set_exception(error)
                return future
            self.dead = reason
            future.set_exception(WorkerDiedError(reason))
        return future

    def _dead_peer_reason(self) -> str | None:
        """Why a rank process stopped (its traceback's last line if it sent one), or None
        if every rank is alive. Waits a moment for a dying rank's exit to show."""
        deadline = time.monotonic() + 2.0
        while True:
            for i, process in enumerate(self.processes):
                conn = self.conns[i]
                try:
                    failed = conn.recv() if conn.poll() else None
                except (EOFError, OSError):
                    failed = None
                if isinstance(failed, StageFailed):
                    reason = one_line(failed.traceback, last=True)
                    return f"{self._rank_label(i)} failed: {reason}"
                if not process.is_alive():
                    process.join(timeout=1.0)  # the exit code is set on join
                    return f"{self._rank_label(i)} {exit_cause(process.exitcode)}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def check_health(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        for i, process in enumerate(self.processes):
            if not process.is_alive():
                raise WorkerDiedError(f"{self._rank_label(i)} is not running")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.dead is None:
            self.dead = "the executor was shut down"
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:  # failed before the finalizer existed
            _reap(self.processes, self.conns, self.comm, [False])


def _reap(
    processes: list[mp.process.BaseProcess], conns: list[Connection], comm, healthy: list[bool]
) -> None:
    """Tells the ranks to stop (an empty schedule), then reaps them (executor/mp.py's reap,
    which ends any rank still waiting), then unmaps the segment. After a failed step the
    ranks' collectives may be out of step, so nothing is broadcast then: reap ends them."""
    if healthy[0] and all(process.is_alive() for process in processes):
        try:
            comm.broadcast_send(b"")
        except RuntimeError:  # a rank died meanwhile: reap deals with it
            pass
    reap(processes, conns)
    comm.close()


# ---- inside a rank's process -----------------------------------------------------------------


def rank_main(
    config: EngineConfig, tp_rank: int, segment: str, conn: Connection, parent_pid: int
) -> None:
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        from pipellm.parallel.shm_comm import SLOT_BYTES, ShmComm, shm_library
        from pipellm.worker.worker import StageWorker

        torch.set_num_threads(config.threads_per_stage)
        size = config.tensor_parallel_size
        handle = shm_library().shm_open_segment(segment, False, size, tp_rank, SLOT_BYTES)
        comm = ShmComm(handle, size, tp_rank)
        worker = StageWorker(config, 0, tp_rank, comm)
        conn.send(StageReady())
    except BaseException:
        conn.send(StageFailed(traceback.format_exc()))
        return
    try:
        payload = comm.broadcast_recv()
        while payload:  # empty: stop
            worker.execute(pickle.loads(payload))
            # Deliberately unpickled twice. The step streamed the weights through the CPU caches
            # and evicted the unpickler's code and data; doing it once more now, while the engine
            # makes the next schedule, brings them back, so the next schedule's unpickling (on
            # the way to the step's first all-reduce, where rank 0 waits for this rank) runs
            # warm. The result is thrown away; it costs only time this rank would spend idle.
            pickle.loads(payload)
            payload = comm.broadcast_recv()
        comm.close()
    except BaseException:
        try:
            conn.send(StageFailed(traceback.format_exc()))
        finally:
            os._exit(1)  # rank 0 waits on this rank at the next all-reduce: it sees it gone
