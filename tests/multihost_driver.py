"""The driver of test_multihost: runs on the first host of a two-host cluster (RAY_ADDRESS set).

Prints one JSON line: where each stage ran and its greedy tokens, the error for a pipeline
the cluster cannot hold, and how a killed second host ends a run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from pipellm import LLM, SamplingParams
from pipellm.executor.base import WorkerDiedError
from pipellm.executor.ray_cluster import RayClusterError

PROMPTS = ["The three primary colors are", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def main(raylet_pid_file: str) -> None:
    report: dict = {}
    started = time.monotonic()
    try:
        LLM(pipeline_parallel_size=3, distributed_executor_backend="ray")
    except RayClusterError as error:
        report["too_big"] = {"error": str(error), "seconds": time.monotonic() - started}
    llm = LLM(pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        executor = llm.engine.executor
        report["stages"] = [vars(loc) for loc in executor.locations]
        report["tokens"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
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
    main(sys.argv[1])
