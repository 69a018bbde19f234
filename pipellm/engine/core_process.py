"""The engine core in its own process, so the scheduler loop and the API's event loop never
wait on each other.

Messages are the dataclasses of protocol.py (ToCore, FromCore) over one multiprocessing Pipe:
a socketpair between this process and its parent only, so nothing is unpickled from a socket
another host could reach.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import traceback
import weakref
from multiprocessing.connection import Connection, wait

from pipellm.config import EngineConfig
from pipellm.engine.core import EngineCore
from pipellm.protocol import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreReady,
    EngineOutput,
    FromCore,
    Outputs,
    Rejected,
    Shutdown,
    StatsReply,
    StatsRequest,
    ToCore,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # the built-in model plus P stage processes on a slow CPU
HEALTH_CHECK_INTERVAL_S = 1.0  # how often an idle core checks that its stages still live
SHUTDOWN_TIMEOUT_S = 15.0  # a graceful stop: stages reaped, trace written


class EngineStartupError(RuntimeError):
    """The engine core process could not start; the message says why."""


class CoreProcess:
    """Parent-side handle of the engine core process: start, wait until ready, stop."""

    def __init__(self, config: EngineConfig) -> None:
        context = mp.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        # NOTE: not a daemon: daemonic processes may not start the pipeline stage processes.
        self.process = context.Process(
            target=core_main, args=(config, child_conn), name="pipellm-engine-core"
        )
        self.process.start()
        child_conn.close()  # so that the core's death reads as EOF here
        self.ready = False
        # Reap the core even if the owner never calls shutdown().
        self._finalizer = weakref.finalize(self, _stop, self.process, self.conn, False)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Blocks until the model is loaded; raises EngineStartupError if the core fails."""
        ready = wait([self.conn, self.process.sentinel], timeout=timeout_s)
        if not ready:
            raise EngineStartupError(f"the engine core did not start within {timeout_s:.0f} s")
        if self.conn.poll():
            message: FromCore = self.conn.recv()
            if isinstance(message, CoreReady):
                self.ready = True
                return
            assert isinstance(message, CoreDead), message
            raise EngineStartupError(message.reason)
        raise EngineStartupError(
            f"the engine core process exited with code {self.process.exitcode} while starting"
        )

    def send(self, message: ToCore) -> None:
        self.conn.send(message)

    def shutdown(self) -> None:
        """Stops the core (gracefully if it is up) and reaps it and its stages; idempotent."""
        self._finalizer.detach()
        _stop(self.process, self.conn, self.ready)


def _stop(process: mp.process.BaseProcess, conn: Connection, graceful: bool) -> None:
    if graceful and process.is_alive():
        try:
            conn.send(Shutdown())
        except OSError:
            pass
        process.join(SHUTDOWN_TIMEOUT_S)
    if process.is_alive():
        process.terminate()  # the core turns SIGTERM into an orderly exit that reaps its stages
        process.join(SHUTDOWN_TIMEOUT_S)
    if process.is_alive():
        process.kill()  # its stages notice the missing parent and exit on their own
        process.join()
    conn.close()


# ---- inside the engine core process ----------------------------------------------------------


def core_main(config: EngineConfig, conn: Connection) -> None:
    """Loads the engine, then serves the parent until SHUTDOWN, EOF or a fatal error."""
    # NOTE: Ctrl-C reaches the whole process group; the API process decides when the engine
    # stops, so the core (and the stage processes, which inherit this) ignore SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        core = EngineCore(config)
    except BaseException:
        conn.send(CoreDead(f"the engine failed to start:\n{traceback.format_exc()}"))
        return
    inbox: queue.SimpleQueue[ToCore] = queue.SimpleQueue()
    threading.Thread(target=_read_inputs, args=(conn, inbox), daemon=True).start()
    conn.send(CoreReady(os.getpid()))
    exit_code = 0
    try:
        serve_messages(core, conn, inbox)
    except SystemExit:
        logger.info("engine core stopping on SIGTERM")
    except BaseException as error:
        logger.exception("the engine core failed")
        try:
            conn.send(CoreDead(f"the engine core failed: {type(error).__name__}: {error}"))
        except OSError:
            pass
        exit_code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut this short
        core.shutdown()
    sys.exit(exit_code)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _read_inputs(conn: Connection, inbox: queue.SimpleQueue[ToCore]) -> None:
    """Moves messages from the pipe to the inbox at once, so the API never waits on a step."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(Shutdown())  # the API process is gone: stop and reap the stages


def serve_messages(core: EngineCore, conn: Connection, inbox: queue.SimpleQueue[ToCore]) -> None:
    """The engine loop: blocks on the inbox when idle; when busy, takes what arrived, then steps.

    `pipellm simulate` runs this same loop with an inbox and connection in virtual time.

    NOTE: while requests are unfinished, step() always has work or blocks on an in-flight
    micro-batch (the config guarantees a lone request fits the KV cache), so this never spins.
    """
    while True:
        if not core.has_unfinished_requests():
            try:
                message = inbox.get(timeout=HEALTH_CHECK_INTERVAL_S)
            except queue.Empty:
                message = None
            if message is None:
                core.executor.check_health()  # a stage that died while idle ends the engine now
                continue
            if not _handle(core, conn, message):
                return
        while True:
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                break
            if not _handle(core, conn, message):
                return
        outputs = core.step()
        if outputs:
            conn.send(Outputs(outputs))


def _handle(core: EngineCore, conn: Connection, message: ToCore) -> bool:
    """Applies one message; returns False when the core should stop."""
    match message:
        case AddRequest(request_id, prompt_token_ids, params):
            try:
                core.add_request(request_id, prompt_token_ids, params)
            except ValueError as error:
                conn.send(Rejected(request_id, str(error)))
            except Exception as error:  # a bug met by this request: fail it, keep serving
                logger.exception("adding request %s failed", request_id)
                failed = EngineOutput(
                    request_id,
                    [],
                    "",
                    finished=True,
                    request_finished=True,
                    finish_reason="error",
                    error=type(error).__name__,
                )
                conn.send(Outputs([failed]))
        case AbortRequests(request_ids):
            for request_id in request_ids:
                core.abort_request(request_id)
        case StatsRequest(token):
            conn.send(StatsReply(token, core.stats()))
        case Shutdown():
            return False
        case _:
            raise ValueError(f"unknown message {message!r} from the API process")
    return True
