"""Stopping `pipellm serve` without cutting clients off: the graceful drain on SIGTERM/SIGINT.

As Kubernetes expects of a pod told to stop (and as uvicorn and vLLM do), the first SIGTERM or
SIGINT starts a drain rather than an exit:
1. new requests, on new or kept-alive connections, get 503 in OpenAI's error shape (the
   listening socket stays open, so a client learns why instead of meeting a refused
   connection); /health answers 503 too, which takes the server out of a load balancer;
2. requests already in flight run on for up to --shutdown-timeout seconds;
3. those still running then are ended: a stream with an error event and `data: [DONE]`, a
   plain request with a 503 JSON error;
4. once no request is left, uvicorn closes the connections and the server exits 0.
A second signal skips the wait: what runs is ended at once (step 3).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pipellm.entrypoints.openai_protocol import error_body

logger = logging.getLogger(__name__)

ENDED_GRACE_S = 5.0  # after ending the requests left, how long they get to write their ends


class DrainState:
    """Shared by the gate and the server: whether a drain runs, how many requests are open."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


class DrainGate:
    """ASGI middleware: counts the HTTP requests in progress (a stream until its last byte)
    and, once the drain started, answers every new one 503."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            message = "the server is shutting down and takes no new requests; retry elsewhere"
            body = error_body(message, "server_error", code="shutting_down")
            response = JSONResponse(body, status_code=503, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose exit signals start the drain above. `end_requests` ends the
    requests still running when the timeout passes (it returns how many it ended)."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: DrainState,
        timeout_s: float,
        end_requests: Callable[[], int],
    ) -> None:
        super().__init__(config)
        self.drain = state
        self.timeout_s = timeout_s
        self.end_requests = end_requests
        self._deadline: float | None = None
        self._ended_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not uvicorn's handler, which exits at once and re-raises the signal after
        # the server stopped; this one only moves the drain on (on the main thread, which
        # runs the event loop, between two of its steps).
        now = time.monotonic()
        if self._deadline is None:
            self.drain.draining = True
            self._deadline = now + self.timeout_s
            logger.info(
                "draining: %d request(s) in flight get up to %g s to finish "
                "(--shutdown-timeout); new ones get 503",
                self.drain.in_flight,
                self.timeout_s,
            )
        else:
            self._deadline = min(self._deadline, now)

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.drain.in_flight == 0:
                logger.info("drained: no request left in flight")
                self.should_exit = True
            elif self._ended_at is None and now >= self._deadline:
                self._ended_at = now
                ended = self.end_requests()
                logger.warning("drain timeout: ended %d request(s) still running", ended)
            elif self._ended_at is not None and now >= self._ended_at + ENDED_GRACE_S:
                self.should_exit = True  # uvicorn's own shutdown handles what is left
        return await super().on_tick(counter)
