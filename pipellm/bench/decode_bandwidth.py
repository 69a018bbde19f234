"""A one-sequence decode step against the machine's read bandwidth, at 1 and 2 threads.

A decode step of one sequence reads every weight once (and the sequence's KV cache), so its
floor is those bytes over the memory's read bandwidth. This measures the read bandwidth
(`torch.sum` over 512 MB of float32, median of 5: a pure read stream), then the built-in
SmolLM2-135M's decode step after a 256-token prompt (`--decode-tokens` greedy tokens; (full run
- prefill run) / tokens), for each quantization setting, and prints the step's bytes over its
time as a fraction of the bandwidth. Settings and thread counts take turns, each run a fresh
process.

    cpulock bench .venv/bin/python -m pipellm.bench.decode_bandwidth  # gguf, gguf_int8; 1, 2 thr.
    .venv/bin/python -m pipellm.bench.decode_bandwidth --settings gguf --threads 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT_LEN = 256


def child(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from pipellm import LLM, SamplingParams
    from pipellm.bench.gguf_gemm import read_bandwidth
    from pipellm.model.gguf_linear import QuantizedLinear
    from pipellm.model.linear import PackedLinear

    llm = LLM(None, max_num_seqs=1, enable_prefix_caching=False, quantization=args.setting)
    torch.set_num_threads(args.threads)
    model = llm.engine.executor.worker.model
    weight_bytes = sum(
        m.packed_weight.numel() * m.packed_weight.element_size()
        for m in model.modules()
        if isinstance(m, QuantizedLinear | PackedLinear)
    )
    config = llm.config.model_config
    kv_bytes_per_token = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    )  # float32 keys and values, read once a step
    generator = torch.Generator().manual_seed(args.seed)

    def run(max_tokens: int) -> float:
        prompt = torch.randint(100, 40000, (PROMPT_LEN,), generator=generator).tolist()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - started

    run(2)
    prefill = statistics.median(run(1) for _ in range(3))
    full = run(args.decode_tokens + 1)
    step = (full - prefill) / args.decode_tokens
    llm.shutdown()
    mean_context = PROMPT_LEN + args.decode_tokens / 2
    return {
        "step_ms": step * 1e3,
        "weight_mb": weight_bytes / 1e6,
        "kv_mb": kv_bytes_per_token * mean_context / 1e6,
        "bandwidth_gb_s": read_bandwidth(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["gguf", "gguf_int8"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--thread-count", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.threads = args.thread_count
        print(json.dumps(child(args)))
        return

    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 means noise)")
    runs = [(s, t) for t in args.threads for s in args.settings]
    results: dict[tuple[str, int], list[dict[str, float]]] = {run: [] for run in runs}
    for rep in range(args.repeats):
        for setting, threads in runs if rep % 2 == 0 else runs[::-1]:
            command = [sys.executable, __file__, "--child", "--setting", setting]
            command += ["--thread-count", str(threads), "--decode-tokens", str(args.decode_tokens)]
            command += ["--seed", str(args.seed + rep)]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[(setting, threads)].append(r)
            print(f"  rep {rep} {setting:9s} {threads} threads " + json.dumps(r), flush=True)

    print(f"\nmedians of {args.repeats}; bytes a step = packed weights + float32 KV at the mean")
    print(f"context ({PROMPT_LEN} + {args.decode_tokens} / 2 tokens)")
    for (setting, threads), rs in results.items():
        m = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        step_bytes = (m["weight_mb"] + m["kv_mb"]) * 1e6
        achieved = step_bytes / (m["step_ms"] / 1e3) / 1e9
        floor_ms = step_bytes / m["bandwidth_gb_s"] / 1e6
        print(
            f"{setting:9s} {threads} threads: read bandwidth {m['bandwidth_gb_s']:5.1f} GB/s; "
            f"step {m['step_ms']:6.2f} ms for {step_bytes / 1e6:5.1f} MB = {achieved:5.1f} GB/s, "
            f"{achieved / m['bandwidth_gb_s']:.0%} of it (floor {floor_ms:.2f} ms)"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
