"""A small thread pool for the CPU work a request needs before it is scheduled: rendering its
chat template, tokenizing its prompt, compiling its structured-output constraint.

Run on the event loop, any of these stalls every other request and /health for as long as it
takes (a 100,000-item choice list, a chat of 125,000 messages). Here they run on a few
threads; the loop only awaits them. The queue is bounded: past `max_queued` waiting jobs a
request is refused with 503 at once, so a flood of expensive requests cannot queue work
without end. A job may be given a deadline: the request is then refused when it passes,
while the thread finishes the job and only then frees its slot (a thread cannot be stopped),
so the bound on the work in progress holds even for jobs nobody waits for any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pipellm.entrypoints.openai_protocol import OpenAIError

T = TypeVar("T")


class RequestPrep:
    """Runs blocking functions off the event loop, at most `num_threads` at a time."""

    def __init__(self, num_threads: int, max_queued: int) -> None:
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="pipellm-prep")
        self._max_jobs = num_threads + max_queued
        self.num_jobs = 0  # running or queued, including those whose caller gave up

    async def run(
        self, function: Callable[..., T], *args: object, timeout_s: float | None = None
    ) -> T:
        """function(*args) on a pool thread; its exceptions propagate. Raises OpenAIError(503)
        when the queue is full, TimeoutError when timeout_s passes first."""
        if self.num_jobs >= self._max_jobs:
            raise OpenAIError(
                f"the server is busy preparing {self.num_jobs} requests; retry shortly",
                status_code=503,
                type="server_error",
                code="server_busy",
            )
        self.num_jobs += 1
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, function, *args)
        future.add_done_callback(self._job_done)
        # shield: a caller that times out or is cancelled leaves the job to finish and free its
        # slot; awaiting the bare future would cancel it only while still queued.
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)

    def _job_done(self, future: asyncio.Future[object]) -> None:
        self.num_jobs -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a job nobody awaits logs no "never retrieved"

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
