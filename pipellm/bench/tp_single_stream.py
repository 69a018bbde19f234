"""One sequence's decode latency: TP = 2 (1 thread per rank) against one process with 2 threads,
both engines alive in one process and taking turns step by step.

pp_scaling alternates whole runs; on a machine whose second core is shared, the speed drifts by
10-30% between runs of a few seconds (and between runs of this script), more than the
difference measured here. Here each engine decodes one request, and they take turns in bursts
of --burst decode steps (A B B A ...), so both see the same drift; the first --settle steps of
each burst are not counted (an engine's first step after the other's pays for waking up: TP's
rank 1 has gone to sleep, and the other engine's idle OpenMP thread may still spin on a core,
so alternating single steps measured TP 1.3x slower than it runs). The report gives each
one's median step time (= time per output token) and their ratio, and the median of the
ratios of adjacent bursts' medians. Each round is a fresh request of --input-len random tokens
decoding --output-len tokens in each engine. The TP engine's rank 0 runs in this process
(executor/tp_driver.py) and wants 1 thread, the other engine 2: torch's thread count is set
before each burst.

    .venv/bin/python -m pipellm.bench.tp_single_stream [--rounds 8 --output-len 128]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from pipellm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--rounds", type=int, default=8, help="requests per engine")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--burst", type=int, default=16, help="decode steps per turn")
    parser.add_argument("--settle", type=int, default=3, help="first steps of a turn not counted")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    common = dict(
        model=args.model,
        max_num_seqs=4,
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,
    )
    engines = {
        "d: 1 process, 2 threads": (LLM(num_threads=2, **common), 2),
        "t: TP=2, 1 thread each": (LLM(tensor_parallel_size=2, num_threads=1, **common), 1),
    }
    names = list(engines)
    vocab = engines[names[0]][0].engine.config.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    bursts: dict[str, list[float]] = {name: [] for name in engines}  # each burst's median
    try:
        for i in range(args.rounds + 1):  # round 0 warms up
            prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
            for llm, threads in engines.values():
                torch.set_num_threads(threads)
                llm.engine.add_request(f"{i}", prompt, params)
                llm.engine.step()  # the prefill, not timed
            for turn in range((args.output_len - 1) // args.burst):
                for name in names if turn % 2 == 0 else names[::-1]:
                    llm, threads = engines[name]
                    torch.set_num_threads(threads)
                    steps = []
                    for _ in range(args.burst):
                        started = time.perf_counter()
                        llm.engine.step()
                        steps.append(time.perf_counter() - started)
                    if i > 0:
                        times[name] += steps[args.settle :]
                        bursts[name].append(statistics.median(steps[args.settle :]))
            for llm, threads in engines.values():  # the steps left over, not timed
                torch.set_num_threads(threads)
                while llm.engine.has_unfinished_requests():
                    llm.engine.step()
    finally:
        for llm, _ in engines.values():
            llm.shutdown()
    d, t = (times[name] for name in names)
    for name, values in times.items():
        ms = [v * 1e3 for v in values]
        quartiles = statistics.quantiles(ms, n=4)
        print(
            f"{name:26s} time per output token: median {statistics.median(ms):.2f} ms "
            f"(quartiles {quartiles[0]:.2f}, {quartiles[2]:.2f}; {len(ms)} steps)"
        )
    ratio = statistics.median(t) / statistics.median(d)
    pairs = statistics.median(b / a for a, b in zip(*bursts.values(), strict=True))
    print(f"(t) against (d): {ratio:.3f}x the time per token; adjacent bursts, median {pairs:.3f}x")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
