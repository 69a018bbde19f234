"""The contract every backend (in-process, mp, ray, sim) fulfils for the engine core."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from pipellm.protocol import ModelOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A stage process or actor is gone; the engine cannot continue."""


class Executor(ABC):
    """Runs micro-batches through the pipeline stages.

    `submit` must not wait for the micro-batch to finish: the engine keeps up to P
    (pipeline_parallel_size) micro-batches in flight, plus pp_async_batch_depth spare ones
    that queue at the first stage. Futures complete in submission order.
    """

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        """Starts a micro-batch through every stage; the future holds the sampled tokens."""

    @abstractmethod
    def check_health(self) -> None:
        """Raises WorkerDiedError if any stage is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops every stage and reaps its process; safe to call twice."""
