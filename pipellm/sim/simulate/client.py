"""The simulated engine loop's only stand-in: the API server and `bench serve`'s client."""

from __future__ import annotations

import heapq
import math
import queue
from collections import deque
from typing import Any

from pipellm.bench.metrics import RequestTiming
from pipellm.protocol import AddRequest, FromCore, Outputs, Rejected, Shutdown, ToCore
from pipellm.sim.clock import VirtualClock
from pipellm.sim.cost import Serving

EngineRequest = tuple[str, list[int], Any, int]  # (id, prompt ids, SamplingParams, prompt_len)


class VirtualClient:
    """The engine loop's inbox and connection: requests in at their send times, tokens out.

    Sends follow `bench serve`: request i is due at start + offsets[i] and waits for one of
    max_concurrency slots (first come, first served); a slot frees when the client has the
    request's last token. The serving path's delays come from the profile's `serving`
    section: the client sends one request at a time (send_interval_s apart), a request
    reaches the engine request_latency_s after it is sent, and a token reaches the client
    output_latency_s after the engine emits it.
    """

    def __init__(
        self,
        clock: VirtualClock,
        requests: list[EngineRequest],
        offsets: list[float],
        max_concurrency: int,
        serving: Serving,
    ) -> None:
        self.clock = clock
        self.requests = requests
        self.serving = serving
        start = clock.now
        self._due = deque((start + offset, i) for i, offset in enumerate(offsets))
        self._queued: deque[int] = deque()  # due, waiting for a slot
        self._free_slots = max_concurrency
        self._slot_frees: list[float] = []  # heap: when finished requests' slots free
        self._in_transit: list[tuple[float, int]] = []  # heap: (reaches the engine, request)
        self._client_now = start  # the client has acted on everything before this
        self._last_send = -math.inf
        self._unfinished = len(requests)
        self._index = {request_id: i for i, (request_id, *_) in enumerate(requests)}
        self.outputs = [RequestTiming(prompt_len=r[3]) for r in requests]
        self._texts: list[list[str]] = [[] for _ in requests]

    @property
    def end_time(self) -> float:
        """When the client had the last token of the last request."""
        return max(out.end_time for out in self.outputs)

    # ---- the client, between engine events ---------------------------------------------------

    def _next_client_event(self) -> tuple[float, str]:
        events = [(math.inf, "none")]
        if self._due:
            events.append((self._due[0][0], "due"))
        if self._slot_frees:
            events.append((self._slot_frees[0], "free"))
        if self._queued and self._free_slots:
            send_at = max(self._client_now, self._last_send + self.serving.send_interval_s)
            events.append((send_at, "send"))
        return min(events)

    def _run_client_until(self, until: float) -> None:
        while True:
            when, kind = self._next_client_event()
            if when > until:
                break
            self._client_now = max(self._client_now, when)
            if kind == "due":
                self._queued.append(self._due.popleft()[1])
            elif kind == "free":
                heapq.heappop(self._slot_frees)
                self._free_slots += 1
            else:
                i = self._queued.popleft()
                self._free_slots -= 1
                self._last_send = when
                self.outputs[i].start_time = when
                heapq.heappush(self._in_transit, (when + self.serving.request_latency_s, i))
        self._client_now = max(self._client_now, until)

    def _arrived(self) -> ToCore | None:
        self._run_client_until(self.clock.now)
        if not (self._in_transit and self._in_transit[0][0] <= self.clock.now):
            return None
        request_id, prompt_ids, params, _ = self.requests[heapq.heappop(self._in_transit)[1]]
        return AddRequest(request_id, prompt_ids, params)

    # ---- the inbox ---------------------------------------------------------------------------

    def get_nowait(self) -> ToCore:
        message = self._arrived()
        if message is None:
            raise queue.Empty
        return message

    def get(self, timeout: float | None = None) -> ToCore:
        """The engine is idle: the next request, after waiting for it if need be; SHUTDOWN
        when every request is done."""
        while (message := self._arrived()) is None:
            if not self._unfinished:
                return Shutdown()
            when = self._next_client_event()[0]
            if self._in_transit:
                when = min(when, self._in_transit[0][0])
            if when == math.inf:
                raise RuntimeError("the engine is idle but requests are open; none can finish")
            self.clock.advance_to(when)
        return message

    # ---- the connection ----------------------------------------------------------------------

    def send(self, message: FromCore) -> None:
        seen = self.clock.now + self.serving.output_latency_s
        if isinstance(message, Rejected):
            i = self._index[message.request_id]
            self.outputs[i].error = message.reason
            self._finish(i, seen, success=False)
        elif isinstance(message, Outputs):
            for out in message.outputs:
                i = self._index[out.request_id]
                request = self.outputs[i]
                request.output_tokens += len(out.new_token_ids)
                if out.new_text:  # as bench serve's client: only chunks with text are timed
                    request.chunk_times.append(seen)
                    self._texts[i].append(out.new_text)
                if out.request_finished:
                    self._finish(i, seen, success=True)

    def _finish(self, i: int, seen: float, success: bool) -> None:
        out = self.outputs[i]
        out.end_time = seen
        out.success = success
        out.generated_text = "".join(self._texts[i])
        heapq.heappush(self._slot_frees, seen)
        self._unfinished -= 1
