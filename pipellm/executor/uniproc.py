"""One stage in the engine's own process: no pipeline, no IPC."""

from __future__ import annotations

import socket
import time
from concurrent.futures import Future

import torch

from pipellm.config import EngineConfig
from pipellm.executor.base import Executor
from pipellm.protocol import ModelOutput, SchedulerOutput
from pipellm.worker.stage_memory import host_limit, log_host_memory
from pipellm.worker.worker import StageWorker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(config.threads_per_stage)
        host = socket.gethostname()
        self.worker = StageWorker(config, stage_index=0, check_host=host)
        log_host_memory(host, {self.worker.memory.name: self.worker.memory.planned}, host_limit())

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        future: Future[ModelOutput] = Future()
        try:
            started = time.time()
            output = self.worker.execute(scheduler_output)
            output.stage_times = [(started, time.time())]
            future.set_result(output)
        except BaseException as error:  # surfaced where the engine waits on the future
            future.set_exception(error)
        return future

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
