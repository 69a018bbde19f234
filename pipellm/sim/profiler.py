"""`pipellm profile`: times real stage steps on this machine and fits the linear cost model.

Each stage of P = 1 and P = 2 (by default) is built in this process, as its worker would build
it (weights, KV cache, kernels, --num-threads torch threads), and runs a grid of made-up
micro-batches: decode batches of several rows and contexts, prefill chunks of several sizes,
some after a cached context. The median time of each is fitted by least squares, relative to
the time (so short steps weigh as much as long ones), to pipellm/sim/cost.py's linear model:

    time = step_s + L (layer_s + layer_token_s T + layer_request_s R + layer_pair_s A
                       + layer_context_s C)
           [+ head_s + head_sampled_s S on the last stage]

Stages of different sizes (P = 1 has every layer, P = 2 half) separate the per-layer terms
from the per-step ones. The engine's own time per micro-batch (scheduling, output processing,
statistics), which delays every micro-batch's start, is measured too, by running the real
engine loop over zero-cost stages; with the streamed timing, each micro-batch's timestamps give
the hand-over costs (pipellm/sim/hand_over.py): link.latency_s is the median stage -> next
stage gap, and link.dispatch_s the engine loop plus the median submit -> stage 0 and last stage
-> result gaps (queueing behind the micro-batch before excluded; the simulator adds it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pipellm.sim.cost import LinearCoefficients, LinearStageCost
from pipellm.sim.hand_over import HandOver, MicroBatchRecord, hand_over
from pipellm.sim.shapes import BatchShape

# (cached context, scheduled tokens) of each request in a grid micro-batch.
# Decodes at three contexts: a decode row's attention reads its whole context (layer_context_s),
# and prompt chunks after a cached context separate that from the prompt's pairs.
DECODE_GRID = [[(context, 1)] * rows for rows in (1, 2, 4, 8) for context in (128, 512, 1024)]
PREFILL_GRID = [
    [(0, 16)],
    [(0, 64)],
    [(0, 128)],
    [(256, 128)],
    [(512, 128)],
    [(896, 128)],
    [(0, 512)],
    [(0, 1024)],
    [(0, 512)] * 4,  # whole prompts batched, as --no-pp-balance schedules them
    [(0, 512)] * 8,  # ... eight at once, max_num_seqs of them at a concurrency of 8
    [(1024, 1)] * 4 + [(0, 124)],  # a balanced micro-batch: decodes and a prompt chunk
    [(512, 1)] * 4 + [(256, 124)],  # decodes and a chunk after a cached context
    # Balanced P=2 with a few requests: a chunk beside one decode, and a prompt's last few
    # tokens (what is left of it after 128-token chunks) beside decodes.
    [(512, 1), (256, 127)],
    [(512, 1)] * 2 + [(500, 12)],
]


def grid(max_model_len: int) -> list[list[tuple[int, int]]]:
    """The grid's micro-batches whose requests fit the context (a small model's may not)."""
    return [
        chunks
        for chunks in DECODE_GRID + PREFILL_GRID
        if all(cached + num_new < max_model_len for cached, num_new in chunks)
    ]


@dataclass
class Sample:
    num_layers: int
    is_last: bool
    batch: BatchShape
    seconds: float


def _scheduler_output(chunks: list[tuple[int, int]], ids: itertools.count, config: Any):
    from pipellm.protocol import ScheduledRequest, SchedulerOutput
    from pipellm.sampling_params import SamplingParams

    requests, next_block = [], 0
    window_pools = [group.num_blocks for group in config.kv_cache_groups[1:]]
    for cached, num_new in chunks:
        total = cached + num_new
        num_blocks = -(-total // config.block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        requests.append(
            ScheduledRequest(
                request_id=f"p{next(ids)}",
                num_computed_tokens=cached,
                num_scheduled_tokens=num_new,
                new_token_ids=[7] * total,
                new_block_ids=blocks,
                sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                sample=True,
                # Sliding-window groups' pools are smaller: only the time counts, so blocks
                # may repeat (block 0 is their null block).
                new_group_block_ids=[[1 + b % (n - 1) for b in blocks] for n in window_pools],
            )
        )
        next_block += num_blocks
    return SchedulerOutput(0, requests)


def _stage_process(config: Any, stage: int, repeats: int, barrier: Any, conn: Any) -> None:
    """One stage of a P-stage pipeline, built in its own process as its mp worker builds it,
    timing every grid micro-batch alone (the other stages wait at the barrier) and with all P
    stages computing at once (as the mp backend's stages do when the pipeline is full)."""
    try:
        conn.send(_time_stage(config, stage, repeats, barrier))
    except BaseException as error:  # the parent reports it; the barrier frees the others
        barrier.abort()
        conn.send(error)
    finally:
        conn.close()


def _time_stage(config: Any, stage: int, repeats: int, barrier: Any) -> dict[str, Any]:
    import torch

    from pipellm.worker.worker import StageWorker

    torch.set_num_threads(config.threads_per_stage)
    worker = StageWorker(config, stage)
    num_stages = config.pipeline_parallel_size
    ids = itertools.count()
    previous: list[str] = []
    points = []

    def run(chunks: list[tuple[int, int]]) -> tuple[float, float, BatchShape]:
        nonlocal previous
        output = _scheduler_output(chunks, ids, config)
        output.freed_request_ids, previous = previous, [r.request_id for r in output.requests]
        hidden = None
        if not worker.is_first:
            hidden = torch.randn(output.num_tokens, config.model_config.hidden_size)
        started = time.perf_counter()  # CLOCK_MONOTONIC: comparable across the processes
        worker.execute(output, hidden)
        return started, time.perf_counter(), BatchShape.of(output)

    for chunks in grid(config.max_model_len):
        barrier.wait()
        run(chunks)  # warms caches and allocations up, all stages at once
        alone, together = [], []
        for _ in range(repeats):
            for turn in range(num_stages):  # alone: one stage at a time
                barrier.wait()
                if turn == stage:
                    started, ended, batch = run(chunks)
                    alone.append(ended - started)
                barrier.wait()
            if num_stages > 1:  # together: every stage at once
                barrier.wait()
                started, ended, batch = run(chunks)
                together.append((started, ended))
                barrier.wait()
        points.append({"batch": batch, "alone": alone, "together": together})
    layers = worker.stage.layer_end - worker.stage.layer_start
    return {"layers": layers, "is_last": worker.is_last, "points": points}


def time_pipeline(config: Any, repeats: int) -> tuple[list[Sample], list[tuple[BatchShape, float]]]:
    """Every stage of config's pipeline in its own process: each grid point's median time
    alone (the samples the linear model is fitted to), and the slowdown of each repeat when
    all P stages compute at once (empty at P = 1).

    A slowdown is measured on the stage that finished first among those started together: it
    computed with all P stages busy throughout, so its time together over its median time
    alone is the rate at which P concurrent stages progress (docs/simulation.md)."""
    import multiprocessing

    from pipellm.executor.mp import join_or_kill

    context = multiprocessing.get_context("spawn")  # as the mp backend starts its stages
    size = config.pipeline_parallel_size
    barrier = context.Barrier(size, timeout=600)
    pipes = [context.Pipe(duplex=False) for _ in range(size)]
    processes = [
        context.Process(
            target=_stage_process,
            args=(config, stage, repeats, barrier, pipes[stage][1]),
            name=f"pipellm-profile-{stage}",
            daemon=True,
        )
        for stage in range(size)
    ]
    results: list[Any] = []
    try:
        for process in processes:
            process.start()
        for stage, (receiver, sender) in enumerate(pipes):
            sender.close()  # so a stage that dies unheard ends recv() with EOFError
            try:
                results.append(receiver.recv())
            except EOFError:
                raise RuntimeError(f"timing stage {stage} of {size}: its process died") from None
    finally:
        join_or_kill(processes, timeout_s=30)
    for stage, result in enumerate(results):
        if isinstance(result, BaseException):
            raise RuntimeError(f"timing stage {stage} of {size} failed: {result!r}") from result
    samples = [
        Sample(r["layers"], r["is_last"], point["batch"], statistics.median(point["alone"]))
        for r in results
        for point in r["points"]
    ]
    slowdowns = []
    for index in range(len(results[0]["points"])):
        per_stage = [(r["points"][index], r) for r in results]
        for repeat in range(len(per_stage[0][0]["together"])):
            runs = [(p["together"][repeat], statistics.median(p["alone"])) for p, _ in per_stage]
            (started, ended), alone = min(runs, key=lambda run: run[0][1])
            if all(other_started <= started + 0.1 * (ended - started)
                   for (other_started, _), _ in runs):  # fmt: skip
                slowdowns.append((per_stage[0][0]["batch"], (ended - started) / alone))
    return samples, slowdowns


def time_streamed(config: Any, repeats: int, passes: int = 2) -> tuple[list[Sample], HandOver]:
    """Every grid point's stage times as the engine's own executor runs them: one unbroken
    stream of micro-batches with the engine's in-flight depth (P plus the spare ones of
    --pp-async-batch-depth), so every stage computes while the others do and its inputs,
    outputs and next schedule cross as they do in serving. Each point is 1 + `repeats`
    consecutive copies (the first, where the shape changes, is not timed), and the grid is
    gone through `passes` times (A B A B: drift over the run touches every point alike).

    Why not the stage alone: replaying a real balanced P=2 run's micro-batches through the mp
    executor took ~10 s of stage time per stage with 2 in flight and 12-13 s with 3 in flight,
    the engine's depth, where the real run took 12 s (docs/simulation.md).

    Every micro-batch's submit time, stage times and result time also give the hand-over
    costs (pipellm/sim/hand_over.py): link.latency_s and the executor's part of dispatch_s."""
    from pipellm.executor.factory import make_executor

    executor = make_executor(config)
    depth = config.max_micro_batches_in_flight
    ids = itertools.count()
    points = grid(config.max_model_len)
    times: list[list[list[float]]] = [[[] for _ in range(config.pipeline_parallel_size)]
                                      for _ in points]  # fmt: skip
    shapes: list[BatchShape | None] = [None] * len(points)
    in_flight: deque[tuple[int, bool, Any, float]] = deque()
    previous: list[str] = []
    records: list[MicroBatchRecord] = []

    def collect() -> None:
        index, timed, future, submitted = in_flight.popleft()
        output = future.result()
        # result() can return just before the done callback has run: then it is now.
        resulted = getattr(future, "resulted", time.time())
        records.append(MicroBatchRecord(submitted, output.stage_times, resulted))
        if timed:
            for stage, (started, ended) in enumerate(output.stage_times):
                times[index][stage].append(ended - started)

    try:
        micro_batch_id = 0
        for _ in range(passes):
            for index, chunks in enumerate(points):
                for copy in range(1 + repeats):
                    output = _scheduler_output(chunks, ids, config)
                    output.micro_batch_id = micro_batch_id
                    micro_batch_id += 1
                    output.freed_request_ids = previous
                    previous = [r.request_id for r in output.requests]
                    shapes[index] = BatchShape.of(output)
                    submitted = time.time()  # the stages' clock (pipeline_stage.py)
                    future = executor.submit(output)
                    # When the result reaches this process: the executor's reader thread
                    # resolves the future and runs the callback.
                    future.add_done_callback(lambda f: setattr(f, "resulted", time.time()))
                    in_flight.append((index, copy > 0, future, submitted))
                    if len(in_flight) >= depth:
                        collect()
        while in_flight:
            collect()
    finally:
        executor.shutdown()
    specs = [config.stage(stage) for stage in range(config.pipeline_parallel_size)]
    samples = [
        Sample(
            spec.layer_end - spec.layer_start,
            spec.is_last,
            shape,
            statistics.median(times[index][stage]),
        )
        for stage, spec in enumerate(specs)
        for index, shape in enumerate(shapes)
        if shape is not None
    ]
    return samples, hand_over(records)


def fit(samples: list[Sample]) -> tuple[LinearCoefficients, list[float]]:
    """Least squares relative to each time; returns the coefficients and each relative error."""
    rows = []
    for s in samples:
        b, n, last = s.batch, s.num_layers, float(s.is_last)
        rows.append(
            [1, n, n * b.num_tokens, n * b.num_requests, n * b.attention_pairs,
             n * b.context_tokens, last, last * b.num_sampled]
        )  # fmt: skip
    features = np.array(rows, dtype=float)
    seconds = np.array([s.seconds for s in samples])
    weights = 1 / seconds
    solution = _nonnegative_lstsq(features * weights[:, None], seconds * weights)
    names = ["step_s", "layer_s", "layer_token_s", "layer_request_s", "layer_pair_s"]
    names += ["layer_context_s", "head_s", "head_sampled_s"]
    coefficients = LinearCoefficients(**dict(zip(names, solution.tolist(), strict=True)))
    errors = [
        LinearStageCost(s.num_layers, s.is_last, coefficients).seconds(s.batch) / s.seconds - 1
        for s in samples
    ]
    return coefficients, errors


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a time cannot shrink with more work):
    terms whose best value is negative are dropped, one at a time, and the rest refitted."""
    active = list(range(a.shape[1]))
    while True:
        solution = np.zeros(a.shape[1])
        solution[active], *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if solution.min() >= 0:
            return solution
        active.remove(int(np.argmin(solution)))


def engine_seconds_per_step(config: Any) -> float:
    """Wall time per micro-batch of the real engine loop over zero-cost stages."""
    from pipellm.engine.core import EngineCore
    from pipellm.executor.sim import VirtualSimExecutor
    from pipellm.sampling_params import SamplingParams
    from pipellm.sim.clock import VirtualClock
    from pipellm.sim.cost import Link
    from pipellm.sim.profile import Profile

    clock = VirtualClock()
    free = Profile(cost_model="linear", link=Link(), linear=LinearCoefficients())
    core = EngineCore(config, VirtualSimExecutor(config, clock, free), clock=clock.time)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    vocab = config.model_config.vocab_size
    for i in range(8):
        core.add_request(str(i), [(i * 31 + j) % vocab for j in range(256)], params)
    steps = 0
    started = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    elapsed = time.perf_counter() - started
    core.shutdown()
    return elapsed / steps


def _print_fit(title: str, samples: list[Sample], errors: list[float]) -> None:
    print(f"{title}:")
    print(f"{'stage layers':>12s} {'last':>5s} {'tokens':>7s} {'rows':>5s} {'context':>8s} "
          f"{'measured ms':>12s} {'fitted ms':>10s} {'error':>7s}")  # fmt: skip
    for s, e in zip(samples, errors, strict=True):
        print(
            f"{s.num_layers:12d} {s.is_last!s:>5s} {s.batch.num_tokens:7d} "
            f"{s.batch.num_requests:5d} {s.batch.context_tokens:8d} {s.seconds * 1e3:12.2f} "
            f"{s.seconds * (1 + e) * 1e3:10.2f} {e:+7.1%}"
        )
    abs_errors = [abs(e) for e in errors]
    print(f"fit error: mean {statistics.mean(abs_errors):.1%}, max {max(abs_errors):.1%}")


def slowdown_factors(by_size: dict[int, list[float]]) -> list[float]:
    """concurrent_slowdown[k - 1] for k = 1 .. the largest P timed: the median slowdown
    measured with P = k stages computing at once (1 for k = 1; a k not timed takes the
    factor of the largest k below it)."""
    factors = [1.0]
    for k in range(2, max(by_size, default=1) + 1):
        ratios = by_size.get(k)
        factors.append(statistics.median(ratios) if ratios else factors[-1])
    return factors


def profile(args: argparse.Namespace) -> dict[str, Any]:
    from pipellm.config import EngineConfig

    sizes = [int(p) for p in args.pipeline_parallel_sizes.split(",")]
    samples: dict[int, list[Sample]] = {}
    slowdowns: dict[int, list[float]] = {}
    hand_overs: dict[int, HandOver] = {}
    for size in sizes:
        config = EngineConfig(
            model=args.model,
            pipeline_parallel_size=size,
            num_threads=args.num_threads,
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
        )
        if args.timing == "stream":
            print(f"timing the {size} stage(s) of P={size} in a full pipeline ...", flush=True)
            samples[size], hand_overs[size] = time_streamed(config, args.repeats)
            print(f"P={size} hand-over (medians): stage -> stage "
                  f"{hand_overs[size].latency_s * 1e3:.2f} ms, submit -> stage 0 plus last "
                  f"stage -> result {hand_overs[size].dispatch_s * 1e3:.2f} ms")  # fmt: skip
            continue
        print(f"timing the {size} stage(s) of P={size}, alone and together ...", flush=True)
        samples[size], together = time_pipeline(config, args.repeats)
        if size > 1:
            slowdowns[size] = [ratio for _, ratio in together]
        if together:
            print(f"P={size}, every stage computing at once: each step x{{}} its time alone "
                  "(per grid point and repeat: {})".format(
                      f"{statistics.median(slowdowns[size]):.2f}",
                      " ".join(f"{r:.2f}" for r in slowdowns[size])))  # fmt: skip
    everything = [s for size in sizes for s in samples[size]]
    coefficients, errors = fit(everything)
    _print_fit(f"one fit over P = {args.pipeline_parallel_sizes}", everything, errors)
    # Per P: a stage's cost per layer depends on how many layers it holds (at P = 1 this
    # machine's 30-layer stage's prompt chunks ran 22-38% above the joint fit while the
    # 15-layer stages' fitted), so each P timed gets its own fit, which the sim prefers.
    by_size, errors_by_size = {}, {}
    for size in sizes:
        by_size[size], errors_by_size[size] = fit(samples[size])
        _print_fit(f"P={size} ({args.timing})", samples[size], errors_by_size[size])
    # Streamed steps were timed with the other stages computing, so no factor is applied on
    # top of them (an empty concurrent_slowdown: the sim runs stages as separate servers).
    factors = slowdown_factors(slowdowns) if args.timing == "alone" else []
    if factors:
        print("concurrent_slowdown (k stages computing at once, k = 1, 2, ...): " +
              ", ".join(f"{f:.2f}" for f in factors))  # fmt: skip
    engine_loop = engine_seconds_per_step(config)
    print(f"engine loop: {engine_loop * 1e3:.2f} ms per micro-batch")
    # The largest P streamed sets the link (the pipeline whose hand-over matters; P = 1 has
    # none between stages); without streaming (--timing alone) the hand-over stays 0.
    measured = hand_overs[max(hand_overs)] if hand_overs else HandOver(0.0, 0.0)
    dispatch = engine_loop + measured.dispatch_s
    print(
        f"link.latency_s {measured.latency_s * 1e3:.2f} ms, link.dispatch_s {dispatch * 1e3:.2f} "
        "ms (engine loop + submit -> stage 0 + last stage -> result)"
    )
    machine = platform.processor() or platform.machine()
    abs_errors = [abs(e) for e in errors]
    result = {
        "description": f"measured by pipellm profile on {machine}",
        "cost_model": "linear",
        "linear": asdict(coefficients),
        "linear_by_stages": {str(size): asdict(c) for size, c in by_size.items()},
        "concurrent_slowdown": factors,
        "link": {"latency_s": measured.latency_s, "dispatch_s": dispatch},
        "measured_on": {
            "model": config.model_name,
            "num_threads": args.num_threads,
            "pipeline_parallel_sizes": sizes,
            "repeats": args.repeats,
            "timing": args.timing,
        },
        "fit": {
            "mean_abs_error": statistics.mean(abs_errors),
            "max_abs_error": max(abs_errors),
            "slowdowns": {str(size): ratios for size, ratios in slowdowns.items()},
            "engine_loop_s": engine_loop,
            "hand_over": {str(size): asdict(h) for size, h in hand_overs.items()},
        },
        # The grid's median times: the sim pulls its fitted lines toward them
        # (pipellm/sim/cost.py, CorrectedStageCost); fitted_s is the line's, for readers.
        "measured_steps": [
            {
                "pipeline_parallel_size": size,
                "layers": s.num_layers,
                "last_stage": s.is_last,
                **asdict(s.batch),
                "measured_s": s.seconds,
                "fitted_s": s.seconds * (1 + e),
            }
            for size in sizes
            for s, e in zip(samples[size], errors_by_size[size], strict=True)
        ],
    }
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"profile written to {args.output}")
    return result
