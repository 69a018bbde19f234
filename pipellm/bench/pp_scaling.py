"""vLLM issue #27462's experiment scaled to this machine: does pipeline parallelism run in parallel?

SmolLM2-135M, max_num_seqs 8, NUM requests of INPUT random tokens -> OUTPUT new tokens, kept
8 at a time by a closed-loop client (vLLM issue #27462: 4000 -> 32, concurrency 8). Configurations,
run alternately A B C D A B C D ... so machine noise hits all of them alike:
  (a) P=1, 1 thread          (b) P=2, --no-pp-balance (as vLLM before #27462)
  (c) P=2, balanced          (d) P=1, 2 threads
  (g) as (c) with --pp-async-batch-depth 1: a spare micro-batch queued at the first stage
Cluster columns, on a real two-host Ray cluster (--two-hosts builds one on this machine: two
network namespaces joined by a veth pair, a Ray node with 1 CPU in each; root needed), one
stage per host:
  (e) P=2 across hosts, balanced    (f) P=2 across hosts, --no-pp-balance
  (h) as (e) with --pp-async-batch-depth 0: one micro-batch a stage in flight, no spare
  (t) TP=2 x P=1, 1 thread per rank (tensor parallelism, docs/tensor_parallel.md)
Prints throughput, mean TTFT and stage idle fraction of each (medians) and the ratios.

  .venv/bin/python -m pipellm.bench.pp_scaling [--num-prompts 32 --input-len 1024 --output-len 32]
  .venv/bin/python -m pipellm.bench.pp_scaling --two-hosts --only cef

--single-request: the single-request column instead. One prompt of --single-len random tokens
-> 1 token, alone in the engine (time to first token is then the prompt's whole prefill):
  (d) P=1, 2 threads    (e) P=2, chunked pipeline    (f) P=2, --no-enable-chunked-pipeline
  (g) P=2, chunked pipeline with cost-balanced chunks (--pp-chunk-sizing cost)
With the chunked pipeline the prompt's chunks are in both stages at once, so P=2 should come
close to P=1 with the same two cores; without it the stages take turns. Prints the TTFT of
each (median over --repeats, alternating) and (e)/(d), (f)/(d); strong-scaling efficiency is
(d)/(e).

  .venv/bin/python -m pipellm.bench.pp_scaling --single-request [--single-len 2048 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipellm.config import EngineConfig
from pipellm.engine.core import EngineCore
from pipellm.sampling_params import SamplingParams

ON_CLUSTER = dict(distributed_executor_backend="ray")  # joins RAY_ADDRESS's cluster


@dataclass
class Setup:
    label: str
    engine_args: dict


SETUPS = [
    Setup("a: P=1, 1 thread", dict(pipeline_parallel_size=1, num_threads=1)),
    Setup("b: P=2, no balance", dict(pipeline_parallel_size=2, num_threads=1, pp_balance=False)),
    Setup("c: P=2, balanced", dict(pipeline_parallel_size=2, num_threads=1)),
    Setup("d: P=1, 2 threads", dict(pipeline_parallel_size=1, num_threads=2)),
    Setup("e: 2 hosts, balanced", dict(pipeline_parallel_size=2, num_threads=1, **ON_CLUSTER)),
    Setup(
        "f: 2 hosts, no balance",
        dict(pipeline_parallel_size=2, num_threads=1, pp_balance=False, **ON_CLUSTER),
    ),
    Setup(
        "g: P=2, balanced, depth 1",
        dict(pipeline_parallel_size=2, num_threads=1, pp_async_batch_depth=1),
    ),
    Setup("t: TP=2, 1 thread each", dict(tensor_parallel_size=2, num_threads=1)),
    Setup(
        "h: 2 hosts, balanced, depth 0",
        dict(pipeline_parallel_size=2, num_threads=1, pp_async_batch_depth=0, **ON_CLUSTER),
    ),
]

SINGLE_SETUPS = [
    Setup("d: P=1, 2 threads", dict(pipeline_parallel_size=1, num_threads=2)),
    Setup("e: P=2, chunked pipeline", dict(pipeline_parallel_size=2, num_threads=1)),
    Setup(
        "f: P=2, not chunked",
        dict(pipeline_parallel_size=2, num_threads=1, enable_chunked_pipeline=False),
    ),
    Setup(
        "g: P=2, chunked, cost",
        dict(pipeline_parallel_size=2, num_threads=1, pp_chunk_sizing="cost"),
    ),
]


def run_alternately(
    setups: list[Setup],
    args: argparse.Namespace,
    run: Callable[[Setup, argparse.Namespace, str | None], dict],
    trace_prefix: str,
    describe: Callable[[str, dict], str],
    timeline_title: str,
    timeline_seconds: float | None,
) -> dict[str, list[dict]]:
    """Runs each setup --repeats times, in turns (A B C A B C ...) so that machine noise hits
    all of them alike, printing each result; the first round of every pipelined setup writes a
    trace and its timeline PNG."""
    results: dict[str, list[dict]] = {s.label: [] for s in setups}
    for repeat in range(args.repeats):
        for setup in setups:
            trace = None
            if repeat == 0 and setup.engine_args.get("pipeline_parallel_size", 1) > 1:
                trace = f"{args.trace_dir}/{trace_prefix}_{setup.label[0]}.trace.json"
            result = run(setup, args, trace)
            results[setup.label].append(result)
            print(
                f"[{repeat}] {describe(setup.label, result)}  idle "
                + " ".join(f"{x:.0%}" for x in result["stage_idle"]),
                flush=True,
            )
            if trace:
                from pipellm.bench.timeline import render_timeline

                png = trace.replace(".trace.json", "_timeline.png")
                title = setup.label + timeline_title
                render_timeline(trace, png, title=title, seconds=timeline_seconds)
                print(f"    timeline: {png}")
    return results


def run_single(setup: Setup, args: argparse.Namespace, trace_file: str | None) -> dict:
    """TTFT of one random prompt -> 1 token, after a short warm-up request."""
    config = EngineConfig(
        model=args.model,
        max_num_seqs=8,
        max_model_len=args.single_len + 16,
        enable_prefix_caching=False,
        trace_file=trace_file,
        pp_microbatch_tokens=args.pp_microbatch_tokens,
        **setup.engine_args,
    )
    core = EngineCore(config)
    rng = random.Random(1)
    vocab = config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        core.add_request("warm-up", [rng.randrange(vocab) for _ in range(32)], params)
        while core.has_unfinished_requests():
            core.step()
        prompt = [rng.randrange(vocab) for _ in range(args.single_len)]
        since = time.time()
        started = time.perf_counter()
        core.add_request("single", prompt, params)
        while not any(out.request_id == "single" for out in core.step()):
            pass
        ttft = time.perf_counter() - started
        pipeline = core.pipeline_stats.summary(since)
    finally:
        core.shutdown()
    return {
        "ttft_s": ttft,
        "stage_idle": pipeline["stage_idle_fraction"],
        "mean_queue_depth": pipeline["mean_queue_depth"],
    }


def main_single(args: argparse.Namespace) -> None:
    setups = [s for s in SINGLE_SETUPS if s.label[0] in args.only]
    results = run_alternately(
        setups,
        args,
        run_single,
        "single",
        lambda label, r: (
            f"{label:26s} TTFT {r['ttft_s']:6.2f} s  queue depth {r['mean_queue_depth']:.2f}"
        ),
        timeline_title=": one prompt",
        timeline_seconds=None,
    )
    ttft = {label: statistics.median(r["ttft_s"] for r in rs) for label, rs in results.items()}
    print(f"\n{'setup':26s} {'median TTFT s':>14s}   all")
    for label, rs in results.items():
        print(f"{label:26s} {ttft[label]:14.2f}   " + " ".join(f"{r['ttft_s']:.2f}" for r in rs))
    labels = {s.label[0]: s.label for s in setups}
    for num in ("e", "f", "g"):
        if num in labels and "d" in labels:
            ratio = ttft[labels[num]] / ttft[labels["d"]]
            print(f"TTFT ({num})/(d) = {ratio:.2f}x  (strong-scaling efficiency {1 / ratio:.0%})")


def run_once(
    setup: Setup,
    args: argparse.Namespace,
    trace_file: str | None,
    on_core: Callable[[EngineCore], None] | None = None,
) -> dict:
    """One real run; `on_core` sees the engine before the first request (to record its
    micro-batches: pipellm/bench/sim_steps.py)."""
    config = EngineConfig(
        model=args.model,
        max_num_seqs=8,
        max_num_batched_tokens=8 * args.input_len,
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,  # random prompts share nothing; keep it out of the way
        trace_file=trace_file,
        pp_microbatch_tokens=args.pp_microbatch_tokens,
        **setup.engine_args,
    )
    core = EngineCore(config)
    if on_core is not None:
        on_core(core)
    rng = random.Random(0)
    vocab = config.model_config.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sent, first_token, last_token, open_requests = {}, {}, {}, set()
    started = time.perf_counter()
    since = time.time()
    next_prompt = 0
    try:
        while next_prompt < len(prompts) or open_requests:
            while next_prompt < len(prompts) and len(open_requests) < args.concurrency:
                request_id = str(next_prompt)
                core.add_request(request_id, prompts[next_prompt], params)
                sent[request_id] = time.perf_counter()
                open_requests.add(request_id)
                next_prompt += 1
            for out in core.step():
                first_token.setdefault(out.request_id, time.perf_counter())
                if out.finished:
                    open_requests.discard(out.request_id)
                    last_token[out.request_id] = time.perf_counter()
        duration = time.perf_counter() - started
        pipeline = core.pipeline_stats.summary(since)
    finally:
        core.shutdown()
    ttfts = [first_token[r] - sent[r] for r in sent]
    # Every request has output_len tokens (ignore_eos): the time per token after the first.
    tpots = [(last_token[r] - first_token[r]) / max(1, args.output_len - 1) for r in sent]
    return {
        "duration_s": duration,
        "output_tok_s": args.num_prompts * args.output_len / duration,
        "total_tok_s": args.num_prompts * (args.input_len + args.output_len) / duration,
        "mean_ttft_s": statistics.mean(ttfts),
        "median_tpot_s": statistics.median(tpots),
        "stage_idle": pipeline["stage_idle_fraction"],
        "mean_queue_depth": pipeline["mean_queue_depth"],
        "pipeline": pipeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--pp-microbatch-tokens", type=int, default=EngineConfig.pp_microbatch_tokens
    )
    parser.add_argument("--only", default=None, help="which setups to run, e.g. 'bc'")
    parser.add_argument("--trace-dir", default="results", help="traces + timeline PNGs here")
    parser.add_argument(
        "--single-request", action="store_true", help="the single-request column (see above)"
    )
    parser.add_argument("--single-len", type=int, default=2048)
    parser.add_argument(
        "--two-hosts",
        action="store_true",
        help="build a two-host Ray cluster on this machine (network namespaces) for (e), (f)",
    )
    args = parser.parse_args()
    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    if args.single_request:
        args.only = args.only or "defg"
        main_single(args)
        return
    args.only = args.only or "abcdt"
    setups = [s for s in SETUPS if s.label[0] in args.only]
    on_cluster = any(s.engine_args.get("distributed_executor_backend") for s in setups)
    if args.two_hosts and not os.environ.get("RAY_ADDRESS"):
        from pipellm.testing.netns_cluster import TwoHostCluster

        with TwoHostCluster(num_cpus=1) as cluster:  # run all setups on its first host
            argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
            sys.exit(cluster.exec(0, argv, env=cluster.driver_env()).returncode)
    if on_cluster and not os.environ.get("RAY_ADDRESS"):
        parser.error("setups (e) and (f) need a Ray cluster: set RAY_ADDRESS, or --two-hosts")
    results = run_alternately(
        setups,
        args,
        run_once,
        "pp",
        lambda label, r: (
            f"{label:22s} {r['total_tok_s']:8.1f} tok/s  TTFT {r['mean_ttft_s']:6.2f} s"
        ),
        timeline_title="",
        timeline_seconds=20,
    )

    def median(label: str, key: str) -> float:
        return statistics.median(r[key] for r in results[label])

    print(
        f"\n{'setup':22s} {'total tok/s':>12s} {'output tok/s':>13s} {'mean TTFT s':>12s} "
        f"{'TPOT ms':>8s} {'stage idle':>14s}"
    )
    for label in results:
        idle = [
            statistics.median(r["stage_idle"][i] for r in results[label])
            for i in range(len(results[label][0]["stage_idle"]))
        ]
        print(
            f"{label:22s} {median(label, 'total_tok_s'):12.1f} "
            f"{median(label, 'output_tok_s'):13.2f} {median(label, 'mean_ttft_s'):12.2f} "
            f"{median(label, 'median_tpot_s') * 1e3:8.1f} {' '.join(f'{x:.1%}' for x in idle):>14s}"
        )
    labels = {s.label[0]: s.label for s in setups}
    pairs = (
        ("c", "b"),
        ("c", "a"),
        ("c", "d"),
        ("g", "c"),
        ("e", "f"),
        ("e", "c"),
        ("e", "h"),
        ("h", "f"),
        ("t", "d"),
        ("t", "c"),
    )
    for num, den in pairs:
        if num in labels and den in labels:
            ratio = median(labels[num], "total_tok_s") / median(labels[den], "total_tok_s")
            tpot = median(labels[num], "median_tpot_s") / median(labels[den], "median_tpot_s")
            print(f"throughput ({num})/({den}) = {ratio:.2f}x, time per output token {tpot:.2f}x")


if __name__ == "__main__":
    main()
