"""Pipeline stages as Ray actors, on one host or across a cluster: P micro-batches in flight.

One actor per rank: with tensor parallelism T, each stage's T ranks are T actors (ranks
numbered stage-major, as in the mp backend), each in its own placement-group bundle, a stage's
bundles on one host where the cluster allows, so its all-reduces go through shared memory.
Micro-batches travel as in the mp backend, only on TCP instead of pipes: the driver sends each
SchedulerOutput to every actor over that actor's channel (stage_channel.py), hidden states go
stage to stage over torch.distributed, and the last stage's rank 0 sends the micro-batch's
ModelOutput back on its channel. Ray places and starts the actors, answers pings, and names a
stage that died (each actor's long-running `run` call fails when its actor does). Which Ray,
and where each rank runs, is ray_cluster's business. Startup, in phases that each fail fast
and name the rank and host:
  1. every actor checks that its host can open the model and says where it runs;
  2. the first stage opens the rendezvous on its own host's address (loopback when all stages
     share one host) and the others join it;
  3. the driver measures each stage's clock offset, so stage timings line up on its clock;
  4. the driver connects to each actor's channel, with a key only the actors got (by Ray).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pipellm.config import EngineConfig
from pipellm.executor import ray_cluster, stage_channel
from pipellm.executor.base import WorkerDiedError
from pipellm.executor.pending import PendingOutputs
from pipellm.executor.ray_stage import StageActor, StageLocation
from pipellm.executor.remote import RemoteStagesExecutor
from pipellm.protocol import ModelOutput, SchedulerOutput, StageFailed, one_line
from pipellm.worker.stage_memory import (
    HostLimit,
    StageMemory,
    check_host_fits,
    log_host_memory,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
CLOCK_SAMPLES = 5
DIAGNOSE_TIMEOUT_S = 3.0  # a live stage answers a ping on a spare thread, beside its steps
# An idle stage answers a ping in about a millisecond; Linux's scheduler runs every runnable
# thread within tens of milliseconds even with dozens competing for 2 cores (CFS: about 3 ms
# per runnable thread), so 5 s unanswered while nothing is in flight means a stage whose host
# is gone, cut off or frozen, never a busy one. Ray itself takes 15-25 s to declare such a
# host dead (its node health check), or forever for a frozen stage process.
IDLE_PING_TIMEOUT_S = 5.0
SPARE_ACTOR_THREADS = 4  # a stage actor's threads beyond its `run` call: pings, clock reads


class RayExecutor(RemoteStagesExecutor):
    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.num_stages = config.pipeline_parallel_size
        self.tp_size = config.tensor_parallel_size
        self.num_ranks = self.num_stages * self.tp_size
        self.output_rank = (self.num_stages - 1) * self.tp_size  # samples (docs/tensor_parallel.md)
        self._pending = PendingOutputs()
        self._closed = False
        self._failing, self._failed = threading.Lock(), False
        self.actors: list[Any] = []
        self._held = _Held(ray_cluster.connect(self.num_ranks))
        # Stop the stages and a private Ray even if the owner forgets to call shutdown().
        self._finalizer = weakref.finalize(self, _release, self._held)
        try:
            bundle = ray_cluster.stage_bundle(config)
            self._held.group = ray_cluster.place_stages(self.num_ranks, bundle)
            order = ray_cluster.rank_order(
                ray_cluster.bundle_nodes(self._held.group),
                ray.get_runtime_context().get_node_id(),
                self.tp_size,
            )
            actor_class = ray.remote(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                # `run` holds one thread for the actor's life; pings and clock reads need more.
                max_concurrency=1 + SPARE_ACTOR_THREADS,
            )(StageActor)
            self.actors = [
                actor_class.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._held.group, placement_group_bundle_index=order[rank]
                    )
                ).remote(config, rank)
                for rank in range(self.num_ranks)
            ]
            self._held.actors = self.actors
            self.locations: list[StageLocation] = self._wait_all(
                [a.locate.remote() for a in self.actors], "check the model"
            )
            self.pids = [loc.pid for loc in self.locations]
            self._check_memory(
                self._wait_all([a.plan_memory.remote() for a in self.actors], "plan its memory")
            )
            one_host = len({loc.node_id for loc in self.locations}) == 1
            first = self.actors[0].open_rendezvous.remote(one_host)
            host, port = self._wait_all([first], "open the rendezvous")[0]
            self._wait_all([a.start.remote(host, port, one_host) for a in self.actors], "start")
            here = ray.get_runtime_context().get_node_id()
            self.clock_offsets = [  # a stage on the driver's host shares its clock
                0.0 if loc.node_id == here else _clock_offset(partial(_read_clock, actor))
                for actor, loc in zip(self.actors, self.locations, strict=True)
            ]
            self._lift_priorities()
            self.conns = self._open_channels(here)
        except BaseException:
            self.shutdown()
            raise
        for rank, loc in enumerate(self.locations):
            logger.info(
                "%s on host %s (%s, pid %d, clock offset %+.3f ms)",
                self._name(rank),
                loc.address,
                loc.hostname,
                loc.pid,
                self.clock_offsets[rank] * 1e3,
            )
        self._pings: list[Future[Any]] = []
        self._idle_since: float | None = None  # when the unanswered ping round went out idle
        self._reader = threading.Thread(
            target=self._read_outputs, name="pipellm-ray-outputs", daemon=True
        )
        self._reader.start()

    def _lift_priorities(self) -> None:
        """Every stage undoes the nice value Ray started it at (ray_stage.normal_priority);
        one that may not is named in a warning, with the fix."""
        niceness = self._wait_all(
            [a.lift_priority.remote() for a in self.actors], "lift its priority"
        )
        for rank, left in enumerate(niceness):
            if left is not None:
                logger.warning(
                    "%s (%s) runs at nice %d, as Ray started it, and yields its core to every "
                    "other process of its host: start that host's Ray with RAY_worker_niceness=0 "
                    "in its environment, or allow its user to lower a nice value (RLIMIT_NICE)",
                    self._name(rank),
                    self._where(rank),
                    left,
                )

    def _open_channels(self, here: str) -> list[Any]:
        """Starts every actor's `run` and connects to its channel; a stage that fails or does
        not answer within STARTUP_TIMEOUT_S fails the start, named."""
        authkey = os.urandom(32)
        addresses = self._wait_all(
            [
                actor.open_channel.remote(authkey, loc.node_id == here)
                for actor, loc in zip(self.actors, self.locations, strict=True)
            ],
            "open its channel",
        )
        self._runs = [actor.run.remote() for actor in self.actors]
        for rank, run in enumerate(self._runs):
            run.future().add_done_callback(lambda f, rank=rank: self._run_ended(f, rank))
        # Connecting blocks until the stage accepts: in threads, so a stage that never does
        # fails the start after the timeout rather than hanging it.
        pool = ThreadPoolExecutor(len(addresses), thread_name_prefix="pipellm-connect")
        connecting = [pool.submit(stage_channel.connect, tuple(a), authkey) for a in addresses]
        pool.shutdown(wait=False)
        wait_futures(connecting, timeout=STARTUP_TIMEOUT_S)
        conns = self._held.conns  # closed at release, even those of a start that fails
        for rank, future in enumerate(connecting):
            if not future.done():
                raise WorkerDiedError(
                    f"{self._name(rank)} ({self._where(rank)}) did not accept the driver's "
                    f"channel within {STARTUP_TIMEOUT_S:g} s"
                )
            try:
                conns.append(future.result())
            except Exception as error:
                raise WorkerDiedError(
                    f"could not connect to {self._name(rank)} ({self._where(rank)}) at "
                    f"{addresses[rank][0]}:{addresses[rank][1]}: {type(error).__name__}: {error}"
                ) from error
        return conns

    def _check_memory(self, plans: list[tuple[StageMemory, HostLimit]]) -> None:
        """Logs each stage's memory and each host's total, and fails before anything loads,
        naming the host, if a host's stages do not fit in its memory limit."""
        hosts: dict[str, tuple[StageLocation, HostLimit, dict[str, StageMemory]]] = {}
        for rank, (memory, limit) in enumerate(plans):
            loc = self.locations[rank]
            logger.info("%s on host %s: %s", self._name(rank), loc.address, memory.describe())
            hosts.setdefault(loc.node_id, (loc, limit, {}))[2][self._name(rank)] = memory
        for loc, limit, stages in hosts.values():
            log_host_memory(f"{loc.address} ({loc.hostname})", stages, limit)
            check_host_fits(f"{loc.address} ({loc.hostname})", stages, limit)

    def _wait_all(self, refs: list[Any], what: str) -> list[Any]:
        """Results of one startup phase; the first failure raises at once, naming its stage."""
        import ray

        waiting = dict(enumerate(refs))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting:
            ready, _ = ray.wait(
                list(waiting.values()), timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise WorkerDiedError(
                    f"Ray pipeline stages did not {what} within {STARTUP_TIMEOUT_S:g} s"
                )
            for rank, ref in list(waiting.items()):
                if ref in ready:
                    try:
                        ray.get(ref)
                    except Exception as error:
                        raise WorkerDiedError(
                            f"{self._name(rank)} ({self._where(rank)}) failed to {what}: "
                            f"{_cause(error)}"
                        ) from error
                    del waiting[rank]
        return ray.get(refs)

    def _name(self, rank: int) -> str:
        if self.tp_size == 1:
            return f"pipeline stage {rank}"
        stage, tp_rank = divmod(rank, self.tp_size)
        return f"pipeline stage {stage} (tensor-parallel rank {tp_rank})"

    def _where(self, rank: int) -> str:
        locations = getattr(self, "locations", None)
        if locations is None:
            return "Ray actor"
        loc = locations[rank]
        return f"host {loc.address}, pid {loc.pid}"

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelOutput]:
        future = self._pending.add()
        if future.done():
            return future
        self._idle_since = None  # the ping round now races steps: stop timing it
        failed = stage_channel.send_schedule(self.conns, scheduler_output)
        if failed is not None:
            rank, error = failed
            self._stage_failed(rank, f"could not send it a micro-batch: {error}")
        return future

    def _read_outputs(self) -> None:
        """Resolves futures in submission order from the output rank's channel; a stage's
        failure message or closed channel fails the executor, naming the stage."""
        from multiprocessing.connection import wait

        watched = {conn: rank for rank, conn in enumerate(self.conns)}
        while not self._closed and not self._pending.dead:
            try:
                ready = wait(list(watched), timeout=1.0)
            except OSError:
                return  # closed by shutdown
            for conn in ready:
                rank = watched[conn]
                try:
                    message = conn.recv()
                except Exception as error:  # EOFError, OSError; or closed under it by shutdown
                    if self._closed:
                        return
                    del watched[conn]
                    detail = f" ({error})" if str(error) else ""
                    self._stage_failed(rank, f"closed its channel to the driver{detail}")
                    continue
                if isinstance(message, StageFailed):
                    logger.error("%s failed:\n%s", self._name(rank), message.traceback)
                    self._stage_failed(rank, f"failed: {one_line(message.traceback, last=True)}")
                elif isinstance(message, ModelOutput):
                    self._deliver(message)

    def _run_ended(self, done: Future[Any], rank: int) -> None:
        """An actor's `run` call ended: by the actor's or its host's death, a failure (which
        its channel usually told first), or a shutdown."""
        if self._closed:
            return
        error = done.exception()
        if error is None:
            self._stage_failed(rank, "stopped serving micro-batches")
        else:
            self._stage_failed(rank, f"failed: {_cause(error)}")

    def _check(self, done: Future[Any], rank: int) -> None:
        if done.exception() is not None:
            self._stage_failed(rank, f"failed: {_cause(done.exception())}")

    def _stage_failed(self, rank: int, what: str) -> None:
        """Fails every pending micro-batch, once, naming the stage and what it did."""
        with self._failing:
            if self._failed or self._closed:
                return
            self._failed = True
        reason = f"{self._name(rank)} ({self._where(rank)}) {what}"
        # A stage whose peer's host died fails first (its connection is reset): find the stage
        # that is really gone, off the caller's thread, and name it too.
        threading.Thread(target=self._fail_naming_the_dead, args=(reason,), daemon=True).start()

    def _fail_naming_the_dead(self, reason: str) -> None:
        import ray

        pings = [actor.ping.remote() for actor in self.actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=DIAGNOSE_TIMEOUT_S)
        gone = []
        for rank, ping in enumerate(pings):
            if ping not in ready:
                gone.append(f"{self._name(rank)} ({self._where(rank)}) does not answer")
                continue
            try:
                ray.get(ping)
            except Exception as error:
                gone.append(f"{self._name(rank)} ({self._where(rank)}) is gone: {_cause(error)}")
        self._pending.fail("; ".join([reason, *gone]))

    def _deliver(self, output: ModelOutput) -> None:
        # Each stage timed itself on its own clock: move every interval onto the driver's.
        # The times travel along the stages' rank 0s, as the hidden states to the sampler do.
        offsets = self.clock_offsets[:: self.tp_size]
        output.stage_times = [
            (start - offset, end - offset)
            for (start, end), offset in zip(output.stage_times, offsets, strict=True)
        ]
        # One channel, one stage loop: outputs arrive in submission order.
        self._pending.resolve_oldest(output)

    def check_health(self) -> None:
        """Raises if a stage failed; pings every stage, so a stage whose host died while the
        engine is idle (when the engine calls this) is noticed, too. A ping is answered by
        one of the actor's spare threads, beside its steps; none is sent while earlier pings
        are unanswered, and a round is timed only while no micro-batch is in flight (its
        host's cores are then free): unanswered for IDLE_PING_TIMEOUT_S, it fails the
        executor naming the silent stages, long before Ray gives up on their host."""
        self._raise_if_dead()
        now = time.monotonic()
        if all(ping.done() for ping in self._pings):
            self._pings = [actor.ping.remote().future() for actor in self.actors]
            self._idle_since = now if self._pending.idle else None
            for rank, ping in enumerate(self._pings):
                ping.add_done_callback(lambda f, rank=rank: self._check(f, rank))
        elif self._idle_since is not None and now - self._idle_since > IDLE_PING_TIMEOUT_S:
            self._fail_silent_stages()
        self._raise_if_dead()

    def _fail_silent_stages(self) -> None:
        with self._failing:
            if self._failed or self._closed:
                return
            self._failed = True
        silent = [
            f"{self._name(rank)} ({self._where(rank)})"
            for rank, ping in enumerate(self._pings)
            if not ping.done()
        ]
        self._pending.fail(
            f"{', '.join(silent)} did not answer a ping within {IDLE_PING_TIMEOUT_S:g} s while "
            "the pipeline was idle: its host is gone or unreachable, or the stage process hung"
        )


@dataclass
class _Held:
    """What the executor must give back: its actors, its placement group, a private Ray."""

    connection: ray_cluster.RayConnection
    actors: list[Any] = field(default_factory=list)
    group: Any = None
    conns: list[Any] = field(default_factory=list)  # the driver's ends of the stage channels


def _release(held: _Held) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for conn in held.conns:  # a stage's loop ends at its channel's end
        conn.close()
    for actor in held.actors:
        try:
            ray.kill(actor)
        except Exception:  # its host may be gone already
            pass
    if held.group is not None:
        try:
            remove_placement_group(held.group)
        except Exception:
            pass
    ray_cluster.disconnect(held.connection)


def _read_clock(actor: Any) -> float:
    import ray

    return ray.get(actor.clock.remote())


def _clock_offset(read_clock: Callable[[], float]) -> float:
    """The stage clock minus the driver's (NTP's estimate: the sample with the shortest
    round trip, its remote reading taken as the midpoint of the trip)."""
    best_rtt, best_offset = float("inf"), 0.0
    for _ in range(CLOCK_SAMPLES):
        sent = time.time()
        remote = read_clock()
        received = time.time()
        if received - sent < best_rtt:
            best_rtt, best_offset = received - sent, remote - (sent + received) / 2
    return best_offset


def _cause(error: BaseException) -> str:
    """The stage's own exception where Ray wrapped one, else Ray's message, in one line."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    if isinstance(error, ActorDiedError | ActorUnavailableError):
        detail = one_line(str(error), default="")
        return f"its Ray actor is gone: the stage process or its host died ({detail})"
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return one_line(str(error), last=True, default=type(error).__name__)
