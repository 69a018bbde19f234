"""Modelled pipeline stages: the engine, scheduler and batch queue run for real, the model
does not.

Each stage is a thread that "computes" a micro-batch by sleeping for the time a roofline model
gives it (weights streamed once per micro-batch versus arithmetic on its tokens), then hands it
to the next stage. The last stage returns made-up but deterministic tokens. Sleeping threads
overlap exactly as real stages on separate devices would, so the seed's scenario (8 stages,
one micro-batch, seven idle) can be reproduced, measured and drawn on a laptop in seconds.
"""

from __future__ import annotations

import queue
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass

from pipellm.config import EngineConfig
from pipellm.executor.base import Executor, WorkerDiedError
from pipellm.model.model_config import ModelConfig
from pipellm.protocol import ModelOutput, SchedulerOutput
from pipellm.worker.partition import partition_layers

# Measured on this project's reference CPU, per thread (see ../shared/CPU_PERF_NOTES.md).
FLOPS_PER_THREAD = 155e9
BYTES_PER_S_PER_THREAD = 12.8e9
STEP_OVERHEAD_S = 2.5e-3  # Python and framework overhead of one stage step


@dataclass(frozen=True)
class StageCostModel:
    """Roofline time of one micro-batch on one stage."""

    num_layers: int
    is_last: bool
    layer_params: int
    head_params: int
    attention_flops_per_context_token: int  # per query token, per layer
    bytes_per_param: int
    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def for_stage(cls, config: EngineConfig, stage: int, speedup: float) -> StageCostModel:
        mc: ModelConfig = config.model_config
        q = mc.num_attention_heads * mc.head_dim
        kv = mc.num_key_value_heads * mc.head_dim
        start, end = partition_layers(mc.num_hidden_layers, config.pipeline_parallel_size)[stage]
        threads = config.threads_per_stage
        return cls(
            num_layers=end - start,
            is_last=stage == config.pipeline_parallel_size - 1,
            layer_params=mc.hidden_size * (2 * q + 2 * kv)
            + 3 * mc.hidden_size * mc.intermediate_size,
            head_params=mc.vocab_size * mc.hidden_size,
            attention_flops_per_context_token=4 * q,
            bytes_per_param=config.torch_dtype.itemsize,
            flops_per_s=FLOPS_PER_THREAD * threads * speedup,
            bytes_per_s=BYTES_PER_S_PER_THREAD * threads * speedup,
        )

    def seconds(self, scheduler_output: SchedulerOutput) -> float:
        tokens = scheduler_output.num_tokens
        # Each query token attends to its context: sum over the chunk of (position + 1).
        context = sum(
            r.num_scheduled_tokens * (r.num_computed_tokens + (r.num_scheduled_tokens + 1) / 2)
            for r in scheduler_output.requests
        )
        flops = self.num_layers * (
            2 * self.layer_params * tokens + self.attention_flops_per_context_token * context
        )
        weight_bytes = self.num_layers * self.layer_params * self.bytes_per_param
        if self.is_last:
            flops += 2 * self.head_params * scheduler_output.num_sampled
            weight_bytes += self.head_params * self.bytes_per_param
        return STEP_OVERHEAD_S + max(flops / self.flops_per_s, weight_bytes / self.bytes_per_s)


def fake_token(request_id: str, position: int, vocab_size: int) -> int:
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


class SimExecutor(Executor):
    def __init__(self, config: EngineConfig, speedup: float = 1.0) -> None:
        self.num_stages = config.pipeline_parallel_size
        self.vocab_size = config.model_config.vocab_size
        self.costs = [StageCostModel.for_stage(config, s, speedup) for s in range(self.num_stages)]
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in range(self.num_stages)]
        self.threads = [
            threading.Thread(target=self._stage, args=(s,), daemon=True, name=f"sim-stage-{s}")
            for s in range(self.num_stages)
        ]
        self._closed = False
        for thread in self.threads:
            thread.start()

    def _stage(self, stage: int) -> None:
        while (item := self.inboxes[stage].get()) is not None:
            scheduler_output, future, times = item
            started = time.time()
            time.sleep(self.costs[stage].seconds(scheduler_output))
            times.append((started, time.time()))
            if stage + 1 < self.num_stages:
                self.inboxes[stage + 1].put(item)
                continue
            tokens = [
                fake_token(r.request_id, r.num_output_tokens, self.vocab_size)
                for r in scheduler_output.requests
                if r.sample
            ]
            future.set_result(ModelOutput(scheduler_output.step_id, tokens, stage_times=times))

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        future: Future[ModelOutput] = Future()
        if self._closed:
            future.set_exception(WorkerDiedError("the executor was shut down"))
        else:
            self.inboxes[0].put((scheduler_output, future, []))
        return future

    def check_health(self) -> None:
        if self._closed:
            raise WorkerDiedError("the executor was shut down")

    def shutdown(self) -> None:
        self._closed = True
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads:
            thread.join(timeout=5.0)
