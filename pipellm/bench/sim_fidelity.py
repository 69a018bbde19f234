"""Does a profile measured here predict real runs? `pipellm profile` times this machine's stage
steps; then pipellm/bench/pp_scaling.py's workloads run for real (P=1; P=2 without and
with balancing; at two concurrencies) and are predicted by `pipellm simulate` with that
profile. Prints throughput, mean TTFT and median TPOT, predicted beside measured, with the error.

pp_scaling's client is in-process (no HTTP), so the profile's serving delays stay at zero.

  .venv/bin/python -m pipellm.bench.sim_fidelity [--num-prompts 16 --input-len 512 --output-len 32]
  .venv/bin/python -m pipellm.bench.sim_fidelity --profile P.json --concurrencies 4 --setups ab
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import tempfile
from pathlib import Path

from pipellm.bench.pp_scaling import SETUPS, run_once
from pipellm.bench.sim_steps import (
    StepRecorder,
    cpu_counters,
    other_processes_cpu,
    print_summary,
    summarize,
)
from pipellm.engine.microbatch_size import DEFAULT_MICROBATCH_TOKENS
from pipellm.entrypoints.cli import build_parser

METRICS = (
    ("output_tok_s", "output_throughput", 1.0, "output tok/s"),
    ("mean_ttft_s", "mean_ttft_ms", 1000.0, "mean TTFT ms"),
    ("median_tpot_s", "median_tpot_ms", 1000.0, "median TPOT ms"),
)


def predict(setup_args: dict, args: argparse.Namespace, concurrency: int, profile: str) -> dict:
    argv = ["simulate", *([args.model] if args.model else [])]
    argv += ["-pp", str(setup_args["pipeline_parallel_size"]), "--num-threads", "1"]
    argv += ["--max-num-seqs", "8", "--max-num-batched-tokens", str(8 * args.input_len)]
    argv += ["--max-model-len", str(args.input_len + args.output_len + 16)]
    argv += ["--no-enable-prefix-caching", "--pp-microbatch-tokens", str(args.pp_microbatch_tokens)]
    argv += [] if setup_args.get("pp_balance", True) else ["--no-pp-balance"]
    argv += ["--sim-profile", profile, "--num-prompts", str(args.num_prompts)]
    argv += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    argv += ["--max-concurrency", str(concurrency)]
    parsed = build_parser().parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        return parsed.func(parsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrencies", default="4,8")
    parser.add_argument("--pp-microbatch-tokens", type=int, default=DEFAULT_MICROBATCH_TOKENS)
    parser.add_argument("--profile", help="use this profile instead of measuring one")
    parser.add_argument(
        "--setups", default="abc", help="pp_scaling's mp setups to run (default %(default)s)"
    )
    parser.add_argument("--out", default=None, help="results folder (default: a temp dir)")
    parser.add_argument(
        "--steps",
        action="store_true",
        help="after each real run, its micro-batches' stage times against the profile's, by "
        "kind of micro-batch (pipellm/bench/sim_steps.py)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    out = Path(args.out or tempfile.mkdtemp(prefix="pipellm-sim-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    profile = args.profile
    if profile is None:
        profile = str(out / "profile.json")
        argv = ["profile", *([args.model] if args.model else []), "--output", profile]
        parsed = build_parser().parse_args(argv)
        parsed.func(parsed)
    # (a) P=1, (b) P=2 --no-pp-balance, (c) P=2 balanced: the mp backend, 1 thread per stage.
    if not set(args.setups) <= set("abc"):
        parser.error(f"--setups: only pp_scaling's mp setups a, b and c, got {args.setups!r}")
    setups = [s for s in SETUPS if s.label[0] in args.setups]
    rows = []
    for concurrency in [int(c) for c in args.concurrencies.split(",")]:
        args.concurrency = concurrency
        for setup in setups:
            recorder = StepRecorder()
            start = cpu_counters()
            measured = run_once(setup, args, None, on_core=recorder if args.steps else None)
            # A real run is only as good as the quiet around it: CPU that other processes
            # took meanwhile (cpulock bench keeps the project's tests out, not everything).
            foreign = other_processes_cpu(start)
            measured["foreign_cpu_s"] = foreign
            predicted = predict(setup.engine_args, args, concurrency, profile)
            rows.append((setup.label, concurrency, measured, predicted))
            print(
                f"{setup.label:22s} concurrency {concurrency}: "
                + ", ".join(
                    f"{name} {predicted[sim_key]:.2f} (measured {measured[real_key] * scale:.2f})"
                    for real_key, sim_key, scale, name in METRICS
                ),
                flush=True,
            )
            print(
                "    micro-batches {}, stage busy s {}, duration s {:.2f}; predicted {}, {}, "
                "{:.2f}; other processes' CPU meanwhile {:.1f} s, load average {:.2f}".format(
                    measured["pipeline"]["num_micro_batches"],
                    [round(b, 2) for b in measured["pipeline"]["stage_busy_s"]],
                    measured["duration_s"],
                    predicted["pipeline"]["num_micro_batches"],
                    [round(b, 2) for b in predicted["pipeline"]["stage_busy_s"]],
                    predicted["duration"],
                    foreign,
                    os.getloadavg()[0],
                ),
                flush=True,
            )
            if args.steps:
                steps = recorder.steps(profile)
                print_summary(summarize(steps), steps)
    print(f"\n{'setup':22s} {'conc':>4s} {'metric':16s} {'predicted':>10s} {'measured':>10s} "
          f"{'error':>7s}")  # fmt: skip
    summary = []
    for label, concurrency, measured, predicted in rows:
        for real_key, sim_key, scale, name in METRICS:
            real, sim = measured[real_key] * scale, predicted[sim_key]
            print(
                f"{label:22s} {concurrency:4d} {name:16s} {sim:10.2f} {real:10.2f} "
                f"{sim / real - 1:+7.1%}"
            )
            summary.append({"setup": label, "concurrency": concurrency, "metric": name,
                            "predicted": sim, "measured": real})  # fmt: skip
    (out / "fidelity.json").write_text(json.dumps(summary, indent=2))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
