"""The driver of test_multihost: runs on the first host of a two-host cluster (RAY_ADDRESS set).

Prints one JSON line: what `pipellm serve` on the cluster answered and left behind, where
each stage ran and its greedy tokens with each host's memory limited to a little more than
half the model, the error for a pipeline the cluster cannot hold and for the whole model on
one host, how an idle pipeline notices its second host frozen, and how a killed second host
ends a run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import psutil

from pipellm import LLM, SamplingParams
from pipellm.config import EngineConfig
from pipellm.engine.core_process import HEALTH_CHECK_INTERVAL_S
from pipellm.executor.base import WorkerDiedError
from pipellm.executor.ray_cluster import RayClusterError
from pipellm.executor.ray_executor import RayExecutor
from pipellm.testing.server_process import ServerProcess
from pipellm.worker.stage_memory import (
    HostMemoryError,
    cgroup_v1_in_use,
    plan_stage_memory,
    resident_bytes,
)

PROMPTS = ["The three primary colors are", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
STAGE_LOG = re.compile(r"(pipeline stage \d+) on host (\S+) \(.*?, pid (\d+),")


def serve(log_path: Path) -> dict:
    """`pipellm serve` with its stages on the cluster: one greedy completion, then Ctrl-C."""
    server = ServerProcess(["--distributed-executor-backend", "ray", "-pp", "2"], log_path)
    started = time.monotonic()
    try:
        server.start()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        completion = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPTS[0],
            temperature=0,
            max_tokens=GREEDY.max_tokens,
            extra_body={"ignore_eos": True},
        )
        stages = [
            {"name": name, "address": address, "pid": int(pid), "netns": _netns(int(pid))}
            for name, address, pid in STAGE_LOG.findall(server.log)
        ]
    finally:
        survivors = server.stop(signal.SIGINT)
    # The stages are Ray's workers, not the server's children: each must be gone, too.
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(s["pid"]) for s in stages) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "text": completion.choices[0].text,
        "stages": stages,
        "exit_code": server.process.returncode,
        "seconds": time.monotonic() - started,
        "survivors": [p.pid for p in survivors]
        + [s["pid"] for s in stages if psutil.pid_exists(s["pid"])],
    }


def _netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def frozen_host(executor: RayExecutor, namespace: str) -> dict:
    """Stops every process of the second host (a host that hangs, or drops off the network)
    while the pipeline is idle, and runs the engine core's idle health check until it fails."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, check=True)
    pids = [int(pid) for pid in listed.stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        while time.monotonic() < frozen + 60:
            try:
                executor.check_health()
            except WorkerDiedError as error:
                return {"error": str(error), "seconds": time.monotonic() - frozen}
            time.sleep(HEALTH_CHECK_INTERVAL_S)
        return {"error": None}
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def limit_memory(cgroups: list[str]) -> dict:
    """Lowers each host's memory cgroup limit to what its processes hold now, plus a stage's
    runtime, plus halfway between what half the model (a stage of -pp 2) and the whole model
    (-pp 1) need to load: -pp 2 across the hosts fits, -pp 1 on one host does not."""
    half = EngineConfig(pipeline_parallel_size=2, distributed_executor_backend="ray")
    whole = EngineConfig(distributed_executor_backend="ray")
    need_half = max(plan_stage_memory(half, stage).to_load for stage in (0, 1))
    need_whole = plan_stage_memory(whole, 0).to_load
    runtime = resident_bytes()  # a stage process's runtime is about this driver's
    limits = []
    for group in cgroups:  # each host from what its own processes hold
        limit = cgroup_v1_in_use(Path(group)) + runtime + (need_half + need_whole) // 2
        limit_file = Path(group, "memory.limit_in_bytes")
        limit_file.write_text(str(limit))
        # The kernel stores the limit rounded down to a page: the engine reports that figure.
        limits.append(int(limit_file.read_text()))
    return {"limits": limits, "half": need_half, "whole": need_whole}


def main(
    raylet_pid_file: str, log_dir: str, second_host_namespace: str, memory_cgroups: str
) -> None:
    report: dict = {"served": serve(Path(log_dir) / "serve.log")}
    started = time.monotonic()
    try:
        LLM(pipeline_parallel_size=3, distributed_executor_backend="ray")
    except RayClusterError as error:
        report["too_big"] = {"error": str(error), "seconds": time.monotonic() - started}
    memory_cgroups = json.loads(memory_cgroups)
    report["memory_limit"] = limit_memory(memory_cgroups)
    llm = LLM(pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        report["stages"] = [vars(loc) for loc in llm.engine.executor.locations]
        outputs = llm.generate(PROMPTS, GREEDY)
        report["tokens"] = [o.outputs[0].token_ids for o in outputs]
        report["texts"] = [o.outputs[0].text for o in outputs]
        report["frozen"] = frozen_host(llm.engine.executor, second_host_namespace)
    finally:
        llm.shutdown()
    # Set again from what the first host holds now (the two-stage pipeline's processes gone).
    report["memory_limit"] = limit_memory(memory_cgroups)
    try:
        LLM(distributed_executor_backend="ray").shutdown()  # the whole model on the first host
        report["whole_model"] = {"error": None}
    except HostMemoryError as error:
        report["whole_model"] = {"error": str(error)}
    llm = LLM(pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        report["stages_again"] = [vars(loc) for loc in llm.engine.executor.locations]
        # Kill the second host's raylet while a long run is in flight.
        with open(raylet_pid_file) as f:
            raylet = int(f.read())
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(raylet, signal.SIGKILL)

        timer = threading.Timer(2.0, kill)
        timer.start()
        try:
            llm.generate(PROMPTS * 8, SamplingParams(max_tokens=400, ignore_eos=True))
            report["killed"] = {"error": None}
        except WorkerDiedError as error:
            report["killed"] = {"error": str(error), "seconds": time.monotonic() - killed_at[0]}
        timer.join()
    finally:
        llm.shutdown()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
