"""The API process's view of the engine core process: async generate, abort, stats, health.

A reader thread blocks on the core's pipe and hands each message to the event loop, which
puts outputs into per-request queues. If the core dies, every waiting request and stats call
fails at once with EngineDeadError, so nothing waits forever on a dead engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from pipellm.engine.core_process import CoreProcess
from pipellm.protocol import (
    AbortRequests,
    AddRequest,
    CoreDead,
    EngineOutput,
    EngineStats,
    FromCore,
    Outputs,
    Rejected,
    StatsReply,
    StatsRequest,
    ToCore,
)
from pipellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 10.0
REAP_TIMEOUT_S = 30.0  # the core reaps its stages (SHUTDOWN_TIMEOUT_S at most) before exiting


class EngineDeadError(RuntimeError):
    """The engine core process is gone or failed; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (a bug it met); the engine serves on."""


class AsyncEngineClient:
    """Create inside the running event loop that will call it; the core must be ready."""

    def __init__(self, core: CoreProcess, on_dead: Callable[[], None] = lambda: None) -> None:
        self.core = core
        self._on_dead = on_dead  # called on the loop once the core is dead (not on close)
        self._loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue[EngineOutput | BaseException]] = {}
        self._stats_waiters: dict[int, asyncio.Future[EngineStats]] = {}
        self._stats_tokens = itertools.count()
        self.dead_reason: str | None = None
        self._closing = False
        self._reader = threading.Thread(
            target=self._read, name="pipellm-engine-reader", daemon=True
        )
        self._reader.start()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.core.process.is_alive()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Yields the request's outputs as the engine makes them; aborts it if left early.

        Raises ValueError if the engine rejects the request, RequestFailedError if it fails
        this request, EngineDeadError if it dies.
        """
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        outputs: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = outputs
        finished = False
        try:
            self._send(AddRequest(request_id, prompt_token_ids, params))
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                finished = item.request_finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
        finally:
            del self._queues[request_id]
            if not finished:  # cancelled, or the consumer stopped reading: free its KV blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self.dead_reason is None:
            try:
                self.core.send(AbortRequests([request_id]))
            except OSError:
                pass  # the reader thread reports the dead core

    async def stats(self) -> EngineStats:
        """The engine's stats snapshot (EngineCore.stats())."""
        self._check_alive()
        token = next(self._stats_tokens)
        reply: asyncio.Future[EngineStats] = self._loop.create_future()
        self._stats_waiters[token] = reply
        try:
            self._send(StatsRequest(token))
            return await asyncio.wait_for(reply, STATS_TIMEOUT_S)
        finally:
            del self._stats_waiters[token]

    def end_requests(self, error: BaseException) -> int:
        """Ends every request waiting for outputs with `error` (a server stopping after its
        drain timeout); returns how many. The engine is stopped next, so nothing is aborted."""
        for outputs in self._queues.values():
            outputs.put_nowait(error)
        return len(self._queues)

    def close(self) -> None:
        """Marks an orderly stop, so the core's exit is not logged as a failure; the owner of
        the CoreProcess stops and reaps it."""
        self._closing = True

    # ---- internals ---------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _send(self, message: ToCore) -> None:
        try:
            self.core.send(message)
        except OSError as error:
            raise EngineDeadError(f"the engine core is unreachable: {error}") from error

    def _read(self) -> None:
        """Reader thread: forwards messages to the loop until the core dies or says DEAD."""
        conn, process = self.core.conn, self.core.process
        reason = None
        while reason is None:
            try:
                ready = wait([conn, process.sentinel])
            except OSError:  # the pipe was closed by shutdown
                reason = "the engine core was shut down"
                break
            # Read pending messages before believing the sentinel: a DEAD message says why.
            if conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    reason = _exit_reason(process)
                    break
                if isinstance(message, CoreDead):
                    reason = message.reason
                elif not self._deliver(self._dispatch, message):
                    return
            else:
                reason = _exit_reason(process)
        self._deliver(self._fail_all, reason)
        # Reap the core (it exits after saying DEAD), so no zombie waits for the server's exit.
        process.join(REAP_TIMEOUT_S)
        if not self._closing:
            logger.info("engine core (pid %s) exited with code %s", process.pid, process.exitcode)

    def _deliver(self, callback: Callable[..., None], *args: object) -> bool:
        """Runs callback(*args) on the event loop; False once the loop is gone."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
            return True
        except RuntimeError:  # the loop closed: the server is shutting down
            return False

    def _dispatch(self, message: FromCore) -> None:
        match message:
            case Outputs(outputs):
                for output in outputs:
                    waiting = self._queues.get(output.request_id)
                    if waiting is not None:  # else aborted while its micro-batch was in flight
                        waiting.put_nowait(output)
            case Rejected(request_id, reason):
                if request_id in self._queues:
                    self._queues[request_id].put_nowait(ValueError(reason))
            case StatsReply(token, stats):
                reply = self._stats_waiters.get(token)
                if reply is not None and not reply.done():
                    reply.set_result(stats)

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        if not self._closing:
            logger.error("engine core is dead; failing %d requests: %s", len(self._queues), reason)
            self._on_dead()
        for outputs in self._queues.values():
            outputs.put_nowait(EngineDeadError(reason))
        for reply in self._stats_waiters.values():
            if not reply.done():
                reply.set_exception(EngineDeadError(reason))


def _exit_reason(process: BaseProcess) -> str:
    wait([process.sentinel], timeout=1.0)  # EOF may come a moment before the exit
    return f"the engine core process exited (exit code {process.exitcode})"
