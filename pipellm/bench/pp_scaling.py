"""The seed's experiment scaled to this machine: does pipeline parallelism run in parallel?

SmolLM2-135M, max_num_seqs 8, NUM requests of INPUT random tokens -> OUTPUT new tokens, kept
8 at a time by a closed-loop client (the seed: 4000 -> 32, concurrency 8). Configurations,
run alternately A B C D A B C D ... so machine noise hits all of them alike:
  (a) P=1, 1 thread          (b) P=2, --no-pp-balance (the seed's "before")
  (c) P=2, balanced          (d) P=1, 2 threads
Prints throughput, mean TTFT and stage idle fraction of each (medians) and the ratios.

  .venv/bin/python -m pipellm.bench.pp_scaling [--num-prompts 32 --input-len 1024 --output-len 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pipellm.config import EngineConfig
from pipellm.engine.core import EngineCore
from pipellm.sampling_params import SamplingParams


@dataclass
class Setup:
    label: str
    engine_args: dict


SETUPS = [
    Setup("a: P=1, 1 thread", dict(pipeline_parallel_size=1, num_threads=1)),
    Setup("b: P=2, no balance", dict(pipeline_parallel_size=2, num_threads=1, pp_balance=False)),
    Setup("c: P=2, balanced", dict(pipeline_parallel_size=2, num_threads=1)),
    Setup("d: P=1, 2 threads", dict(pipeline_parallel_size=1, num_threads=2)),
]


def run_once(setup: Setup, args: argparse.Namespace, trace_file: str | None) -> dict:
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
    parser.add_argument("--only", default="abcd", help="which setups to run, e.g. 'bc'")
    parser.add_argument("--trace-dir", default="results", help="traces + timeline PNGs here")
    args = parser.parse_args()
    setups = [s for s in SETUPS if s.label[0] in args.only]
    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {s.label: [] for s in setups}
    for repeat in range(args.repeats):
        for setup in setups:
            trace = None
            if repeat == 0 and setup.engine_args["pipeline_parallel_size"] > 1:
                trace = f"{args.trace_dir}/pp_{setup.label[0]}.trace.json"
            result = run_once(setup, args, trace)
            results[setup.label].append(result)
            print(
                f"[{repeat}] {setup.label:22s} {result['total_tok_s']:8.1f} tok/s  "
                f"TTFT {result['mean_ttft_s']:6.2f} s  idle "
                + " ".join(f"{x:.0%}" for x in result["stage_idle"]),
                flush=True,
            )
            if trace:
                from pipellm.bench.timeline import render_timeline

                png = trace.replace(".trace.json", "_timeline.png")
                render_timeline(trace, png, title=setup.label, seconds=20)
                print(f"    timeline: {png}")

    def median(label: str, key: str) -> float:
        return statistics.median(r[key] for r in results[label])

    print(
        f"\n{'setup':22s} {'total tok/s':>12s} {'output tok/s':>13s} {'mean TTFT s':>12s} "
        f"{'stage idle':>14s}"
    )
    for label in results:
        idle = [
            statistics.median(r["stage_idle"][i] for r in results[label])
            for i in range(len(results[label][0]["stage_idle"]))
        ]
        print(
            f"{label:22s} {median(label, 'total_tok_s'):12.1f} "
            f"{median(label, 'output_tok_s'):13.2f} {median(label, 'mean_ttft_s'):12.2f} "
            f"{' '.join(f'{x:.1%}' for x in idle):>14s}"
        )
    labels = {s.label[0]: s.label for s in setups}
    for num, den in (("c", "b"), ("c", "a"), ("c", "d")):
        if num in labels and den in labels:
            ratio = median(labels[num], "total_tok_s") / median(labels[den], "total_tok_s")
            print(f"throughput ({num})/({den}) = {ratio:.2f}x")


if __name__ == "__main__":
    main()
