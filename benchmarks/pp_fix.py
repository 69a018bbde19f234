"""vLLM's pipeline-parallel fix (issue #27462, PR #28768) measured on this machine at P = 2.

Each configuration is a `pipellm serve -pp 2` server loaded by `pipellm bench serve` (the
random dataset, INPUT -> 32 tokens, concurrency 8), as vLLM's issue ran `vllm bench serve`:

  balanced                 pipellm's default: both halves of the fix
  no-balance               --no-pp-balance: the whole batch in one micro-batch (first half off)
  balanced+blocking        --pp-blocking-loop: the engine waits for each micro-batch's result
                           before scheduling the next (second half off)
  no-balance+blocking      both off: vLLM before the fix
  balanced+cost            --pp-chunk-sizing cost: chunk sizes from the chunk-cost model
                           (pipellm/engine/chunk_cost.py); not run unless named in --setups
  balanced+cost+blocking   the same with --pp-blocking-loop; not run unless named

`--blocking-rows` adds the --pp-blocking-loop twin of every chosen setup that lacks one, so
each half of the fix shows apart (docs/benchmarks.md runs balanced and no-balance this way),
all taking turns in one run.

Configurations take turns (every input length, every configuration, then again for each
--rounds), so machine noise hits all alike. Prints each run's `bench serve` table, then per
input length the request throughput and mean TTFT of each, and balanced over no-balance.

  python benchmarks/pp_fix.py [--input-lens 2048,4000 --num-prompts 32 --rounds 1]
      [--max-num-batched-tokens 16384 --kv-cache-memory BYTES]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pipellm.testing.server_process import ServerProcess

SETUPS = {
    "balanced": [],
    "no-balance": ["--no-pp-balance"],
    "balanced+blocking": ["--pp-blocking-loop"],
    "no-balance+blocking": ["--no-pp-balance", "--pp-blocking-loop"],
    "balanced+cost": ["--pp-chunk-sizing", "cost"],
    "balanced+cost+blocking": ["--pp-chunk-sizing", "cost", "--pp-blocking-loop"],
}
# Each setup's twin with the engine waiting for every micro-batch (the fix's second half off).
BLOCKING_TWIN = {
    "balanced": "balanced+blocking",
    "no-balance": "no-balance+blocking",
    "balanced+cost": "balanced+cost+blocking",
}
DEFAULT_SETUPS = ["balanced", "no-balance", "balanced+blocking", "no-balance+blocking"]
OUTPUT_LEN = 32


def serve_flags(input_len: int, args: argparse.Namespace) -> list[str]:
    """The issue's `serve` shape scaled to P = 2 on a small CPU model."""
    flags = (
        f"-pp 2 --max-num-seqs 8 --max-num-batched-tokens {args.max_num_batched_tokens} "
        f"--max-model-len {input_len + OUTPUT_LEN + 64} --no-enable-prefix-caching"
    ).split()
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    return flags


def run(setup: str, input_len: int, args: argparse.Namespace, out: Path, index: int) -> dict:
    name = f"{index:02d}_{input_len}_{setup.replace('+', '_')}"
    flags = [*serve_flags(input_len, args), *SETUPS[setup]]
    if args.model:
        flags.insert(0, args.model)
    if args.trace:
        flags += ["--trace-file", str(out / f"{name}.trace.json")]
    print(f"\n### {setup}, {input_len} tokens: pipellm serve {' '.join(flags)}", flush=True)
    with ServerProcess(flags, out / f"{name}.log") as server:
        bench = (
            f"--dataset-name random --random-input-len {input_len} --random-output-len "
            f"{OUTPUT_LEN} --random-range-ratio 0 --max-concurrency 8 "
            f"--num-prompts {args.num_prompts} --num-warmups {args.num_warmups}"
        ).split()
        bench += ["--base-url", server.base_url, "--save-result", "--result-dir", str(out)]
        bench += ["--result-filename", f"{name}.json", "--disable-tqdm"]
        print(f"### pipellm bench serve {' '.join(bench)}", flush=True)
        command = [sys.executable, "-m", "pipellm.entrypoints.cli", "bench", "serve", *bench]
        subprocess.run(command, check=True)
    return json.loads((out / f"{name}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model for `pipellm serve` (default: its built-in one)")
    parser.add_argument("--input-lens", default="2048,4000")
    # vLLM's run gave its 8 x 4000-token prompts a 32000-token batch and KV room for all: at
    # 4000 tokens, 16384 and the default 1 GiB of KV cache (5 such prompts) let --no-pp-balance
    # spread them over micro-batches that overlap, so it is not one whole-batch micro-batch.
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument(
        "--kv-cache-memory", type=int, help="bytes, passed to `pipellm serve` (default: its own)"
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-warmups", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--setups",
        default=",".join(DEFAULT_SETUPS),
        help=f"comma-separated, of {', '.join(SETUPS)}",
    )
    parser.add_argument(
        "--blocking-rows",
        action="store_true",
        help="also run each chosen setup's --pp-blocking-loop twin, taking turns with it",
    )
    parser.add_argument("--trace", action="store_true", help="write each server's stage trace")
    parser.add_argument("--out", help="results folder (default: a temp dir)")
    args = parser.parse_args()
    setups = [s.strip() for s in args.setups.split(",")]
    for setup in setups:
        if setup not in SETUPS:
            parser.error(f"--setups: unknown {setup!r}; choose from {', '.join(SETUPS)}")
    if args.blocking_rows:
        twins = [BLOCKING_TWIN[s] for s in setups if s in BLOCKING_TWIN]
        setups = list(dict.fromkeys(setups + twins))
    input_lens = [int(n) for n in args.input_lens.split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix="pipellm-pp-fix-"))
    out.mkdir(parents=True, exist_ok=True)

    results: dict[tuple[int, str], list[dict]] = {}
    index = 0
    for _ in range(args.rounds):
        for input_len in input_lens:
            for setup in setups:
                result = run(setup, input_len, args, out, index)
                results.setdefault((input_len, setup), []).append(result)
                index += 1

    print(
        f"\nP = 2, {args.num_prompts} prompts at concurrency 8, medians of {args.rounds} "
        f"round(s); results in {out}"
    )
    incomplete = []
    for input_len in input_lens:
        print(f"\n{input_len} -> {OUTPUT_LEN} tokens")
        print(f"{'configuration':<22} {'req/s':>8} {'mean TTFT ms':>13} {'completed':>10}")
        figures = {}
        for setup in setups:
            runs = results[(input_len, setup)]
            rate = statistics.median(r["request_throughput"] for r in runs)
            ttft = statistics.median(r["mean_ttft_ms"] for r in runs)
            done = min(r["completed"] for r in runs)
            if done < args.num_prompts:
                incomplete.append(f"{setup} at {input_len} tokens: {done}/{args.num_prompts}")
            figures[setup] = (rate, ttft)
            print(f"{setup:<22} {rate:>8.4f} {ttft:>13.0f} {done:>6}/{args.num_prompts}")
        for fixed, broken in [
            ("balanced", "no-balance"),
            ("balanced", "balanced+blocking"),
            ("balanced", "no-balance+blocking"),
            ("balanced+cost", "no-balance"),
            # The first half (balancing) with the loop still blocking, and the second half
            # (the non-blocking loop) with and without balancing.
            ("balanced+blocking", "no-balance+blocking"),
            ("no-balance", "no-balance+blocking"),
            ("balanced+cost", "balanced+cost+blocking"),
        ]:
            if fixed in figures and broken in figures:
                (rate_a, ttft_a), (rate_b, ttft_b) = figures[fixed], figures[broken]
                print(
                    f"{fixed} over {broken}: {rate_a / rate_b:.2f}x req/s, "
                    f"mean TTFT {ttft_b / ttft_a:.2f}x better"
                )
    if incomplete:
        # A run that dropped requests measured less work: its ratios mean nothing.
        sys.exit("requests not completed: " + "; ".join(incomplete))


if __name__ == "__main__":
    main()
