"""The experiment of vLLM issue #27462 itself, 8 pipeline stages, on a laptop: the sim backend
models the stages (real scheduler, batch queue, server and benchmark; no model compute).

Runs the issue's `serve` command line with `--distributed-executor-backend sim`, once as vLLM
ran before its fix (--no-pp-balance: the whole batch in one micro-batch) and once balanced,
each loaded by the issue's `bench serve` command line; prints both tables in the issue's
layout, then the ratios.

  .venv/bin/python -m pipellm.bench.sim_serve [--num-prompts 256 --num-warmups 20 --sim-speedup 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pipellm.bench.server_process import ServerProcess
from pipellm.bench.timeline import render_timeline

SEED_SERVE_FLAGS = (
    "--trust-remote-code --pipeline-parallel-size 8 --tensor-parallel-size 1 --max-num-seqs 8 "
    "--max-cudagraph-capture-size 8 --max-model-len 4042 --max-num-batched-tokens 32000 "
    "--enable-chunked-prefill --kv-cache-dtype auto --gpu-memory-utilization 0.85 "
    "--no-enable-prefix-caching"
).split()
SEED_BENCH_FLAGS = (
    "--dataset-name random --max-concurrency 8 --random-input-len 4000 --random-output-len 32 "
    "--random-range-ratio 0"
).split()


def run(balanced: bool, args: argparse.Namespace, out: Path) -> dict:
    name = "after" if balanced else "before"
    trace = out / f"sim_serve_{name}.trace.json"
    flags = [*SEED_SERVE_FLAGS, "--distributed-executor-backend", "sim"]
    flags += ["--sim-speedup", str(args.sim_speedup), "--kv-cache-memory", str(8 << 30)]
    flags += ["--trace-file", str(trace)] + ([] if balanced else ["--no-pp-balance"])
    print(f"\n### {name}: pipellm serve {' '.join(flags)}", flush=True)
    with ServerProcess(flags, out / f"sim_serve_{name}.log") as server:
        bench = [*SEED_BENCH_FLAGS, "--num-prompts", str(args.num_prompts)]
        bench += ["--num-warmups", str(args.num_warmups), "--base-url", server.base_url]
        bench += ["--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json"]
        print(f"### pipellm bench serve {' '.join(bench)}", flush=True)
        command = [sys.executable, "-m", "pipellm.entrypoints.cli", "bench", "serve", *bench]
        subprocess.run([*command, "--disable-tqdm"], check=True)
        server.stop()
    render_timeline(trace, out / f"sim_serve_{name}_timeline.png", title=f"sim, 8 stages: {name}")
    return json.loads((out / f"{name}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-warmups", type=int, default=8)
    parser.add_argument(
        "--sim-speedup",
        type=float,
        default=4.0,
        help="above ~4 the modelled stages outpace the real engine loop (docs/benchmarks.md)",
    )
    parser.add_argument("--out", default=None, help="results folder (default: a temp dir)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="pipellm-seed-sim-"))
    out.mkdir(parents=True, exist_ok=True)
    before, after = run(False, args, out), run(True, args, out)
    print(f"\nafter / before (sim, 8 stages, speedup {args.sim_speedup:g}x; results in {out}):")
    for key, label in (
        ("output_throughput", "output token throughput"),
        ("total_token_throughput", "total token throughput"),
        ("mean_ttft_ms", "mean TTFT (lower is better)"),
        ("duration", "duration (lower is better)"),
    ):
        print(f"  {label:32s} {after[key] / before[key]:6.2f}x")


if __name__ == "__main__":
    main()
