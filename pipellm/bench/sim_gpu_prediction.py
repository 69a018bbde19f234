"""vLLM issue #27462's 8-GPU result, predicted: `pipellm simulate` with a roofline profile of
its setup (DeepSeek-R1-0528 in NVFP4, one stage per GPU, pipellm/bench/profiles/) runs the issue's
own `serve` and `bench serve` command lines, before (--no-pp-balance) and after, and prints the
prediction beside what the issue measured with the mp backend, with the error.

"after" is vLLM's fix as the issue describes it: at most max_num_seqs / PP new requests per
micro-batch, whole prompts (--pp-microbatch-tokens 32000 lifts pipellm's own 128-token cap,
which vLLM does not have); pipellm's default is shown too. The profile's step_overhead_s is
its one guessed knob, so the prediction is repeated at several values of it.

  .venv/bin/python -m pipellm.bench.sim_gpu_prediction [--overheads 0.002,0.005,0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import tempfile
import time
from pathlib import Path

from pipellm.entrypoints.cli import build_parser

PROFILE = Path(__file__).parent / "profiles" / "deepseek_r1_fp4_pp8_rtx_pro_6000.json"
SERVE_FLAGS = (
    "--trust-remote-code --pipeline-parallel-size 8 --tensor-parallel-size 1 --max-num-seqs 8 "
    "--max-cudagraph-capture-size 8 --max-model-len 4042 --max-num-batched-tokens 32000 "
    "--enable-chunked-prefill --kv-cache-dtype auto --gpu-memory-utilization 0.85 "
    "--no-enable-prefix-caching"
).split()
BENCH_FLAGS = (
    "--dataset-name random --max-concurrency 8 --num-prompts 256 --random-input-len 4000 "
    "--random-output-len 32 --random-range-ratio 0 --num-warmups 20"
).split()
SETUPS = {
    "before": ["--no-pp-balance"],
    "after": ["--pp-microbatch-tokens", "32000"],
    "pipellm default": [],
}
# vLLM issue #27462, mp backend: "before this PR" and "after this PR" (request throughput as
# 256 requests / the stated duration, which the table rounds to 0.64 and 1.61).
MEASURED = {
    "before": {
        "request_throughput": 256 / 402.84,
        "total_token_throughput": 2561.62,
        "mean_ttft_ms": 8007.14,
        "median_ttft_ms": 9785.40,
        "mean_tpot_ms": 147.76,
        "median_tpot_ms": 91.55,
    },
    "after": {
        "request_throughput": 256 / 158.89,
        "total_token_throughput": 6494.74,
        "mean_ttft_ms": 2015.66,
        "median_ttft_ms": 2041.88,
        "mean_tpot_ms": 95.11,
        "median_tpot_ms": 94.66,
    },
}
KEYS = list(MEASURED["before"])


def simulate(profile: Path, flags: list[str]) -> tuple[dict, float]:
    """The result of one simulation and its wall time; its table is not printed."""
    argv = ["simulate", *SERVE_FLAGS, *BENCH_FLAGS, "--sim-profile", str(profile), *flags]
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        result = args.func(args)
    return result, time.perf_counter() - started


def with_overhead(overhead_s: float, folder: Path) -> Path:
    data = json.loads(PROFILE.read_text())
    data["hardware"]["step_overhead_s"] = overhead_s
    data["model"] = str(PROFILE.parent / data["model"])
    path = folder / f"profile_{overhead_s}.json"
    path.write_text(json.dumps(data))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--overheads",
        default="0.002,0.005,0.01",
        help="step_overhead_s values to predict with (the profile says 0.005)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # not the engine's notes on GPU-only flags
    folder = Path(tempfile.mkdtemp(prefix="pipellm-gpu-prediction-"))
    for overhead in [float(x) for x in args.overheads.split(",")]:
        profile = with_overhead(overhead, folder)
        print(f"\nstep_overhead_s = {overhead * 1000:g} ms")
        print(f"{'':16s} {'metric':24s} {'predicted':>10s} {'measured':>10s} {'error':>7s}")
        results = {}
        for name, flags in SETUPS.items():
            results[name], wall = simulate(profile, flags)
            for key in KEYS:
                predicted = results[name][key]
                measured = MEASURED.get(name, {}).get(key)
                error = f"{predicted / measured - 1:+7.0%}" if measured else ""
                shown = f"{measured:10.2f}" if measured else f"{'':10s}"
                print(f"{name:16s} {key:24s} {predicted:10.2f} {shown} {error}")
            print(f"{name:16s} {'(simulated in)':24s} {wall:9.1f}s")
        for key in ("request_throughput", "mean_ttft_ms"):
            predicted = results["after"][key] / results["before"][key]
            measured = MEASURED["after"][key] / MEASURED["before"][key]
            print(
                f"after / before   {key:24s} {predicted:9.2f}x {measured:9.2f}x "
                f"{predicted / measured - 1:+7.0%}"
            )


if __name__ == "__main__":
    main()
