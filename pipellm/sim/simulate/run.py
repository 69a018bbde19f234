"""The simulation's run: warm-ups, then the timed requests, through the engine loop."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from pipellm.bench.serve import arrival_offsets, report
from pipellm.config import EngineConfig
from pipellm.sim.clock import VirtualClock
from pipellm.sim.cost import Serving
from pipellm.sim.simulate.client import EngineRequest, VirtualClient
from pipellm.sim.simulate.workload import ServedParams, workload


def run_phase(
    core: Any,
    clock: VirtualClock,
    requests: list[EngineRequest],
    offsets: list[float],
    max_concurrency: int,
    serving: Serving,
) -> VirtualClient:
    """Runs the engine loop until every request of the phase has finished."""
    from pipellm.engine.core_process import serve_messages

    client = VirtualClient(clock, requests, offsets, max_concurrency, serving)
    serve_messages(core, client, client)  # type: ignore[arg-type]
    clock.advance_to(client.end_time)
    return client


def simulate(
    args: argparse.Namespace, config: EngineConfig, served_params: ServedParams
) -> dict[str, Any]:
    """Runs the workload `args` describe (`bench serve`'s flags) on `config`'s modelled stages;
    prints and returns `bench serve`'s result."""
    from pipellm.engine.core import EngineCore
    from pipellm.executor.sim import VirtualSimExecutor

    wall_start = time.perf_counter()
    clock = VirtualClock()
    executor = VirtualSimExecutor(config, clock)
    core = EngineCore(config, executor, clock=clock.time)
    try:
        requests = workload(args, core.tokenizer, served_params)
        timed, warmups = requests[: args.num_prompts], requests[args.num_prompts :]
        concurrency = args.max_concurrency or len(requests)
        serving = executor.profile.serving
        print(
            f"Simulating {args.num_prompts} requests on {config.pipeline_parallel_size} modelled "
            f"stages ({args.sim_profile or 'the reference CPU roofline'}): request rate "
            f"{args.request_rate}, burstiness {args.burstiness}, max concurrency "
            f"{args.max_concurrency or 'unlimited'}, {args.num_warmups} warmups"
        )
        if warmups:
            run_phase(core, clock, warmups, [0.0] * len(warmups), concurrency, serving)
        start = clock.now
        offsets = arrival_offsets(len(timed), args.request_rate, args.burstiness, args.seed)
        client = run_phase(core, clock, timed, offsets, concurrency, serving)
        duration = clock.now - start
        result = report(args, config.model_name, client.outputs, start, duration)
        # Not bench serve's: where the modelled time went (sim_fidelity compares it).
        result["pipeline"] = core.pipeline_stats.summary(since=start)
    finally:
        core.shutdown()
    wall = time.perf_counter() - wall_start
    speed = clock.now / wall if wall > 0 else math.inf
    print(
        f"Simulated {clock.now:.2f} s of virtual time in {wall:.2f} s of wall time "
        f"({speed:.0f}x real time)"
    )
    return result
