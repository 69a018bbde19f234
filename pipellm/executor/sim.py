"""Modelled pipeline stages: the engine, scheduler and batch queue run for real, the model
does not.

A profile (pipellm/sim/profile.py; by default a roofline of this project's reference CPU)
gives each stage's time for a micro-batch; the last stage returns made-up but deterministic
tokens. Two ways to spend that time:

- `SimExecutor`, real time: each stage is a thread that sleeps for its step time, so stages
  overlap as they would on separate devices and a server can be load-tested as usual.
- `VirtualSimExecutor`, virtual time: stages are FIFO servers, so a micro-batch's whole
  passage is known when it is submitted; its future is complete at once, and waiting for it
  moves a `VirtualClock` to its finish time. The engine loop cannot tell the difference, so
  `pipellm simulate` runs the real engine in a fraction of the time it models.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future
from typing import Any

from pipellm.config import EngineConfig
from pipellm.executor.base import Executor, WorkerDiedError
from pipellm.protocol import ModelOutput, SchedulerOutput
from pipellm.sim.clock import VirtualClock
from pipellm.sim.cost import Hardware, Link, Precision
from pipellm.sim.profile import Profile, load_profile
from pipellm.sim.shapes import BatchShape

logger = logging.getLogger(__name__)

# The default roofline when no --sim-profile is given: a laptop-class x86 core's float32 GEMM
# rate and memory bandwidth per thread, a coarse stand-in (a fitted profile is far closer).
FLOPS_PER_THREAD = 155e9
BYTES_PER_S_PER_THREAD = 12.8e9
STEP_OVERHEAD_S = 2.5e-3  # Python and framework overhead of one stage step


def cpu_profile(config: EngineConfig) -> Profile:
    """The default: a roofline of the reference CPU with the stage's threads."""
    threads = config.threads_per_stage
    itemsize = config.torch_dtype.itemsize
    return Profile(
        cost_model="roofline",
        link=Link(),
        hardware=Hardware(
            flops_per_s=FLOPS_PER_THREAD * threads,
            bytes_per_s=BYTES_PER_S_PER_THREAD * threads,
            step_overhead_s=STEP_OVERHEAD_S,
        ),
        precision=Precision(
            weight_bytes=itemsize,
            head_bytes=itemsize,
            kv_bytes=config.cache_dtype.itemsize,
            activation_bytes=itemsize,
        ),
        description="reference CPU roofline",
    )


def profile_for(config: EngineConfig) -> Profile:
    return load_profile(config.sim_profile) if config.sim_profile else cpu_profile(config)


def fake_token(request_id: str, position: int, vocab_size: int) -> int:
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


class _ModelledStages(Executor):
    """What both executors share: step and link times, and the tokens the last stage returns."""

    def __init__(self, config: EngineConfig, profile: Profile | None = None) -> None:
        self.num_stages = config.pipeline_parallel_size
        self.vocab_size = config.model_config.vocab_size
        self.speedup = config.sim_speedup
        self.profile = profile or profile_for(config)
        self.served_model: dict[str, Any] = config.model_config.hf_config_kwargs()
        self.costs = self.profile.stage_costs(self.served_model, self.num_stages)
        # Stages with the same layers cost the same: evaluate each distinct cost once per
        # micro-batch (an 8-stage simulation evaluates ~10k micro-batches).
        self._distinct_costs = list(dict.fromkeys(self.costs))
        self._cost_of_stage = [self._distinct_costs.index(cost) for cost in self.costs]
        self.dispatch_s = self.profile.link.dispatch_s / self.speedup
        self._link_latency, self._link_per_token = self.profile.link_terms(self.served_model)
        self._closed = False

    def step_times(self, scheduler_output: SchedulerOutput) -> tuple[list[float], float]:
        """(each stage's compute seconds, seconds from one stage to the next)."""
        batch = BatchShape.of(scheduler_output)
        distinct = [cost.seconds(batch) / self.speedup for cost in self._distinct_costs]
        times = [distinct[i] for i in self._cost_of_stage]
        link = self._link_latency + batch.num_tokens * self._link_per_token
        return times, link / self.speedup

    def output(
        self, scheduler_output: SchedulerOutput, stage_times: list[tuple[float, float]]
    ) -> ModelOutput:
        tokens = [
            fake_token(r.request_id, r.num_output_tokens, self.vocab_size)
            for r in scheduler_output.requests
            if r.sample
        ]
        return ModelOutput(scheduler_output.micro_batch_id, tokens, stage_times=stage_times)

    def check_health(self) -> None:
        if self._closed:
            raise WorkerDiedError("the executor was shut down")


class SimExecutor(_ModelledStages):
    """Real time: one sleeping thread per stage."""

    def __init__(self, config: EngineConfig, profile: Profile | None = None) -> None:
        super().__init__(config, profile)
        if self.profile.stages_interfere:
            logger.warning(
                "the real-time sim backend runs each stage at its solo speed: the profile's "
                "concurrent_slowdown is applied only by `pipellm simulate` (virtual time)"
            )
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in range(self.num_stages)]
        self.threads = [
            threading.Thread(target=self._stage, args=(s,), daemon=True, name=f"sim-stage-{s}")
            for s in range(self.num_stages)
        ]
        for thread in self.threads:
            thread.start()

    def _stage(self, stage: int) -> None:
        while (item := self.inboxes[stage].get()) is not None:
            scheduler_output, future, durations, link, dispatched_at, times = item
            # Wait for the hidden states to cross the link from the stage before (the first
            # stage: for the engine's dispatch).
            ready_at = times[-1][1] + link if times else dispatched_at
            time.sleep(max(0.0, ready_at - time.time()))
            started = time.time()
            time.sleep(durations[stage])
            times.append((started, time.time()))
            if stage + 1 < self.num_stages:
                self.inboxes[stage + 1].put(item)
                continue
            future.set_result(self.output(scheduler_output, times))

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        future: Future[ModelOutput] = Future()
        if self._closed:
            future.set_exception(WorkerDiedError("the executor was shut down"))
        else:
            durations, link = self.step_times(scheduler_output)
            dispatched_at = time.time() + self.dispatch_s
            self.inboxes[0].put((scheduler_output, future, durations, link, dispatched_at, []))
        return future

    def shutdown(self) -> None:
        self._closed = True
        for inbox in self.inboxes:
            inbox.put(None)
        for thread in self.threads:
            thread.join(timeout=5.0)


class _VirtualFuture:
    """Complete from the start; waiting for it is waiting until `done_at` on the clock.

    The engine only calls result(): a concurrent.futures.Future's lock and condition, made
    and taken for each of a simulation's ~10k micro-batches, were a tenth of its wall time."""

    def __init__(
        self, clock: VirtualClock, done_at: float, output: Any, error: BaseException | None
    ) -> None:
        self.clock, self.done_at, self._output, self._error = clock, done_at, output, error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        self.clock.advance_to(self.done_at)
        if self._error is not None:
            raise self._error
        return self._output


class VirtualSimExecutor(_ModelledStages):
    """Virtual time: each stage is a FIFO server whose next free instant is all its state.

    If the profile says stages slow each other down (`concurrent_slowdown`: stages sharing
    one machine), a step's end depends on what the other stages do meanwhile, so the passage
    is worked out by `_SharedMachine` when the engine waits for it instead."""

    def __init__(
        self, config: EngineConfig, clock: VirtualClock, profile: Profile | None = None
    ) -> None:
        super().__init__(config, profile)
        self.clock = clock
        self.stage_free_at = [0.0] * self.num_stages
        self.shared = (
            _SharedMachine(self.num_stages, self.profile.slowdown)
            if self.profile.stages_interfere
            else None
        )

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        durations, link = self.step_times(scheduler_output)
        arrival = self.clock.now + self.dispatch_s
        if self.shared is not None:
            passage = self.shared.submit(durations, link, arrival)
            return _SharedFuture(self, scheduler_output, passage)
        stage_times = []
        for stage, duration in enumerate(durations):
            start = max(arrival, self.stage_free_at[stage])
            end = start + duration
            self.stage_free_at[stage] = end
            stage_times.append((start, end))
            arrival = end + link
        future: Any
        if self._closed:
            error = WorkerDiedError("the executor was shut down")
            future = _VirtualFuture(self.clock, stage_times[-1][1], None, error)
        else:
            output = self.output(scheduler_output, stage_times)
            future = _VirtualFuture(self.clock, stage_times[-1][1], output, None)
        return future

    def shutdown(self) -> None:
        self._closed = True


class _Passage:
    """One micro-batch's way down the stages on a shared machine."""

    def __init__(self, durations: list[float], link: float, arrival: float) -> None:
        self.durations = durations
        self.link = link
        self.stage = 0  # the stage it is queued at or computing on
        self.ready_at = arrival  # when its inputs reach that stage
        self.remaining = durations[0]  # seconds of that stage's work left, at full speed
        self.started: float | None = None
        self.stage_times: list[tuple[float, float]] = []

    @property
    def done(self) -> bool:
        return self.stage == len(self.durations)


class _SharedMachine:
    """Stages as FIFO servers that slow each other down: while k stages compute at once,
    each progresses at 1 / slowdown(k) of its full speed (processor sharing, as P stage
    processes share this machine's cores and memory). Events are a step reaching its stage,
    starting and ending; every submission is known before the engine waits for any result
    (the engine submits only at the clock's present), so working the passages out when a
    result is awaited is exact."""

    def __init__(self, num_stages: int, slowdown: Any) -> None:
        self.slowdown = slowdown
        self.queues: list[deque[_Passage]] = [deque() for _ in range(num_stages)]
        self.now = 0.0

    def submit(self, durations: list[float], link: float, arrival: float) -> _Passage:
        passage = _Passage(durations, link, arrival)
        self.queues[0].append(passage)
        return passage

    def run_until_done(self, passage: _Passage) -> None:
        while not passage.done:
            self._next_event()

    def _next_event(self) -> None:
        heads = [queue[0] for queue in self.queues if queue]
        busy = [p for p in heads if p.ready_at <= self.now]
        factor = self.slowdown(len(busy))
        later = [p.ready_at for p in heads if p.ready_at > self.now]
        ends = [self.now + p.remaining * factor for p in busy]
        when = min(later + ends)
        for p in busy:
            if p.started is None:
                p.started = self.now
            p.remaining -= (when - self.now) / factor
        self.now = when
        for p in busy:
            if p.remaining > 1e-12 * max(1.0, p.durations[p.stage]):
                continue
            self.queues[p.stage].popleft()
            p.stage_times.append((p.started, when))
            p.stage += 1
            if not p.done:
                p.ready_at, p.remaining, p.started = when + p.link, p.durations[p.stage], None
                self.queues[p.stage].append(p)


class _SharedFuture(Future):
    """Waiting for it works the shared machine out up to the micro-batch's end."""

    def __init__(
        self, executor: VirtualSimExecutor, scheduler_output: SchedulerOutput, passage: _Passage
    ) -> None:
        super().__init__()
        self.executor, self.scheduler_output, self.passage = executor, scheduler_output, passage

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            executor = self.executor
            if executor._closed:
                self.set_exception(WorkerDiedError("the executor was shut down"))
            else:
                assert executor.shared is not None
                executor.shared.run_until_done(self.passage)
                executor.clock.advance_to(self.passage.stage_times[-1][1])
                self.set_result(executor.output(self.scheduler_output, self.passage.stage_times))
        return super().result(timeout)
