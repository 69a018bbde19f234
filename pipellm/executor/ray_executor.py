"""Pipeline stages as Ray actors: one actor per stage, P micro-batches in flight.

Ray carries each SchedulerOutput to every stage actor (actor calls run in submission order);
hidden states go stage to stage over torch.distributed as in the mp backend, and the last
actor's return value is the micro-batch's ModelOutput. If this process started Ray, it starts
it with explicit CPUs, no dashboard and a temp dir of its own, and shuts it down again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future
from typing import Any

from pipellm.config import EngineConfig
from pipellm.executor.base import Executor, WorkerDiedError
from pipellm.executor.net import free_port
from pipellm.executor.pending import PendingOutputs
from pipellm.protocol import ModelOutput, SchedulerOutput

STARTUP_TIMEOUT_S = 300.0


class _StageActor:
    """Lives in a Ray worker process; wraps the same PipelineStage the mp backend runs."""

    def __init__(self, config: EngineConfig, rank: int, port: int) -> None:
        from pipellm.worker.pipeline_stage import PipelineStage

        self.stage = PipelineStage(config, rank, port)

    def ready(self) -> int:
        return os.getpid()

    def step(self, scheduler_output: SchedulerOutput) -> ModelOutput | None:
        return self.stage.step(scheduler_output)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        import ray

        self.num_stages = config.pipeline_parallel_size
        self._pending = PendingOutputs()
        self._temp_dir: str | None = None
        if not ray.is_initialized():
            self._temp_dir = tempfile.mkdtemp(prefix="pipellm-ray-")
            ray.init(
                num_cpus=max(self.num_stages, os.cpu_count() or 1),
                include_dashboard=False,
                _temp_dir=self._temp_dir,
                log_to_driver=False,
                configure_logging=False,
            )
        actor_class = ray.remote(num_cpus=1)(_StageActor)
        port = free_port()
        self.actors = [actor_class.remote(config, rank, port) for rank in range(self.num_stages)]
        self._finalizer = weakref.finalize(self, _stop_ray, self.actors, self._temp_dir)
        try:
            self.pids = ray.get([a.ready.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        except Exception as error:
            self.shutdown()
            raise WorkerDiedError(f"Ray pipeline stages failed to start: {error}") from error

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        future = self._pending.add()
        if future.done():
            return future
        refs = [actor.step.remote(scheduler_output) for actor in self.actors]
        for rank, ref in enumerate(refs[:-1]):
            ref.future().add_done_callback(lambda f, rank=rank: self._check(f, rank))
        refs[-1].future().add_done_callback(self._deliver)
        return future

    def _check(self, done: Future[Any], rank: int) -> None:
        if done.exception() is not None:
            self._pending.fail(f"pipeline stage {rank} (Ray actor) failed: {done.exception()}")

    def _deliver(self, done: Future[Any]) -> None:
        if done.exception() is not None:
            self._check(done, self.num_stages - 1)
        else:
            self._pending.resolve_oldest(done.result())

    def check_health(self) -> None:
        if self._pending.dead:
            raise WorkerDiedError(self._pending.dead)

    def shutdown(self) -> None:
        self._pending.fail("the executor was shut down", log=False)
        self._finalizer()


def _stop_ray(actors: list[Any], temp_dir: str | None) -> None:
    import ray

    for actor in actors:
        ray.kill(actor)
    if temp_dir is not None:  # we started Ray: stop it and its processes
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
