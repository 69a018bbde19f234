"""One pipeline stage in its own process or actor: schedule in, hidden states through, tokens out.

Backends (mp processes, Ray actors) only deliver each SchedulerOutput to `step`; the stage
itself receives hidden states from the previous stage and sends its own to the next one.

With tensor parallelism T, the T x P ranks are numbered stage-major (rank = stage * T + tp
rank) and each stage's T ranks form a group (parallel/tp_group.py). After each layer's
all-reduce every rank of a stage holds the whole hidden states, so rank t of a stage sends
them straight to rank t of the next: T transfers side by side and no broadcast inside the
receiving stage (docs/tensor_parallel.md).
"""

from __future__ import annotations

import socket
import time
from collections import deque

import torch
import torch.distributed as dist

from pipellm.config import EngineConfig
from pipellm.parallel.tp_group import make_tensor_parallel_comm
from pipellm.protocol import ModelOutput, SchedulerOutput
from pipellm.worker.process_group import Rendezvous, join_pipeline_group
from pipellm.worker.worker import StageWorker

MAX_PENDING_SENDS = 8  # bounded: a send's tensor must stay alive until it completes


class PipelineStage:
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        rendezvous: Rendezvous,
        listener: socket.socket | None = None,
        check_host: str | None = None,
    ) -> None:
        """check_host: this host's name, for the stage to check its memory before loading
        (StageWorker); None where the executor checked the whole host already."""
        torch.set_num_threads(config.threads_per_stage)
        self.rank, self.num_stages = rank, config.pipeline_parallel_size
        self.tp_size = config.tensor_parallel_size
        self.stage, tp_rank = divmod(rank, self.tp_size)  # ranks are stage-major
        spec = config.stage(self.stage)
        self.is_first, self.is_last = spec.is_first, spec.is_last
        world_size = self.num_stages * self.tp_size
        self._group = join_pipeline_group(rendezvous, rank, world_size, listener)
        self.comm = make_tensor_parallel_comm(self.num_stages, self.tp_size, self.stage)
        self.worker = StageWorker(config, self.stage, tp_rank, self.comm, check_host)
        self.hidden_size = config.model_config.hidden_size
        self.dtype = config.torch_dtype
        self.pending_sends: deque[tuple[list[dist.Work], list[torch.Tensor]]] = deque()
        # The next micro-batch's inputs, being received while this stage computes.
        self._prefetched: tuple[int, list[dist.Work], torch.Tensor, torch.Tensor] | None = None

    def step(
        self, scheduler_output: SchedulerOutput, following: SchedulerOutput | None = None
    ) -> ModelOutput | None:
        """Runs one micro-batch through this stage; the last stage's sampling rank returns
        its output. `following`, the next micro-batch when the engine has sent it already:
        its inputs are received while this one computes."""
        hidden_in, times = None, torch.empty(0, 2, dtype=torch.float64)
        if not self.is_first:
            hidden_in, times = self._receive(scheduler_output)
            if following is not None:
                self._prefetch(following)
        started = time.time()  # busy time starts when the inputs are here
        output = self.worker.execute(scheduler_output, hidden_in)
        times = torch.cat([times, torch.tensor([[started, time.time()]], dtype=torch.float64)])
        if self.is_last:
            if output is not None:
                output.stage_times = [tuple(t) for t in times.tolist()]
            return output
        self._send_async([output, times])
        return None

    def _inputs(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.empty(scheduler_output.num_tokens, self.hidden_size, dtype=self.dtype)
        return hidden, torch.empty(self.stage, 2, dtype=torch.float64)

    def _receive(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefetched is not None:
            micro_batch_id, works, hidden, times = self._prefetched
            self._prefetched = None
            if micro_batch_id != scheduler_output.micro_batch_id:
                raise RuntimeError(
                    f"stage {self.stage} received micro-batch {micro_batch_id}'s inputs ahead, "
                    f"but was given micro-batch {scheduler_output.micro_batch_id}"
                )
            for work in works:
                work.wait()
            return hidden, times
        hidden, times = self._inputs(scheduler_output)
        dist.recv(hidden, src=self.rank - self.tp_size)
        dist.recv(times, src=self.rank - self.tp_size)
        return hidden, times

    def _prefetch(self, following: SchedulerOutput) -> None:
        """Posts the receives of the next micro-batch's inputs now. Received only once this
        stage asks for them, they would cross while the previous stage computes its next
        micro-batch, whose process then has to find a core for gloo's sending thread: with a
        spare micro-batch in flight (docs/pipeline.md) the last stage waited about three times
        longer for inputs already sent than with the receives posted early. Receives from one
        stage match in the order they are posted, and this micro-batch's have completed, so the
        order holds."""
        hidden, times = self._inputs(following)
        src = self.rank - self.tp_size
        works = [dist.irecv(hidden, src=src), dist.irecv(times, src=src)]
        self._prefetched = (following.micro_batch_id, works, hidden, times)

    def close(self) -> None:
        for works, _ in self.pending_sends:
            for work in works:
                work.wait()
        if self.comm is not None:
            self.comm.close()
        dist.destroy_process_group()

    def _send_async(self, tensors: list[torch.Tensor]) -> None:
        """Sends without waiting for the next stage to be ready for it."""
        tensors = [t.contiguous() for t in tensors]
        works = [dist.isend(t, dst=self.rank + self.tp_size) for t in tensors]
        self.pending_sends.append((works, tensors))
        while len(self.pending_sends) > MAX_PENDING_SENDS or (
            self.pending_sends and all(w.is_completed() for w in self.pending_sends[0][0])
        ):
            for work in self.pending_sends.popleft()[0]:
                work.wait()
