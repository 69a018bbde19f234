"""Futures of in-flight micro-batches, resolved in submission order, all failed on a death."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future

from pipellm.executor.base import WorkerDiedError
from pipellm.protocol import ModelOutput

logger = logging.getLogger(__name__)


class PendingOutputs:
    """Thread-safe: backends resolve futures from their own reader threads or callbacks."""

    def __init__(self) -> None:
        self._futures: deque[Future[ModelOutput]] = deque()
        self._lock = threading.Lock()
        self.dead: str | None = None  # why the pipeline cannot run any more

    def add(self) -> Future[ModelOutput]:
        """A future for the next submitted micro-batch (already failed if the pipeline is dead)."""
        future: Future[ModelOutput] = Future()
        with self._lock:
            if self.dead is None:
                self._futures.append(future)
                return future
        future.set_exception(WorkerDiedError(self.dead))
        return future

    def resolve_oldest(self, output: ModelOutput) -> None:
        with self._lock:
            if not self._futures:
                return  # failed already
            future = self._futures.popleft()
        future.set_result(output)

    def fail(self, reason: str, log: bool = True) -> None:
        """Marks the pipeline dead and fails every pending future with the first reason."""
        with self._lock:
            if self.dead is None:
                self.dead = reason
                if log:
                    logger.error(reason)
            futures, self._futures = self._futures, deque()
        for future in futures:
            future.set_exception(WorkerDiedError(self.dead))
