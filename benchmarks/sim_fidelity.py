"""Does a profile measured here predict real runs? `pipellm profile` times this machine's stage
steps; then benchmarks/pp_scaling.py's workloads run for real (P=1; P=2 without and
with balancing; at two concurrencies) and are predicted by `pipellm simulate` with that
profile. Prints throughput, mean TTFT and median TPOT, predicted beside measured, with the error.

pp_scaling's client is in-process (no HTTP), so the profile's serving delays stay at zero.

With --steps, every real micro-batch's stage times are also set against the profile's
prediction, grouped by kind of micro-batch, to show which shapes the cost model gets wrong:
`decode xR` (R decode rows only), `chunk` (one prompt chunk of more than 16 tokens, `+dec` with
decode rows beside it), `tail` (a prompt's last few tokens), `prompts xN` (N prompt chunks in
one micro-batch: --no-pp-balance's whole prompts).

  .venv/bin/python benchmarks/sim_fidelity.py [--num-prompts 16 --input-len 512 --output-len 32]
  .venv/bin/python benchmarks/sim_fidelity.py --profile P.json --concurrencies 4 --setups ab
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pp_scaling import SETUPS, run_once

from pipellm.config import EngineConfig
from pipellm.engine.microbatch_size import DEFAULT_MICROBATCH_TOKENS
from pipellm.entrypoints.cli import build_parser
from pipellm.protocol import SchedulerOutput
from pipellm.sim.profile import load_profile
from pipellm.sim.shapes import BatchShape

TAIL_TOKENS = 16  # a prompt chunk this short is a tail: the rest of a 512-token prompt


def machine_cpu_seconds() -> float:
    """CPU seconds every process of this machine has used since boot (/proc/stat: user, nice,
    system, irq, softirq), and this process's share with its reaped children (os.times)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    ticks = sum(int(fields[i]) for i in (0, 1, 2, 5, 6))
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_counters() -> tuple[float, float]:
    """(the machine's, this process tree's) CPU seconds so far: other_processes_cpu's start."""
    return machine_cpu_seconds(), own_cpu_seconds()


def other_processes_cpu(start: tuple[float, float]) -> float:
    """CPU seconds that processes other than this one and its children took since `start`.
    The two counters are sampled apart, so a few ms below zero means none."""
    machine, own = start
    return max(0.0, (machine_cpu_seconds() - machine) - (own_cpu_seconds() - own))


@dataclass
class Step:
    kind: str
    chunks: list[tuple[int, int]]  # (cached context, scheduled tokens) per request
    batch: BatchShape
    measured_s: list[float]  # per stage
    predicted_s: list[float]  # per stage


def kind_of(chunks: list[tuple[int, int]]) -> str:
    prompts = [n for _, n in chunks if n > 1]
    decodes = len(chunks) - len(prompts)
    if not prompts:
        return f"decode x{decodes}"
    if len(prompts) > 1:
        return f"prompts x{len(prompts)}" + (f" +{decodes} dec" if decodes else "")
    name = "tail" if prompts[0] <= TAIL_TOKENS else "chunk"
    return name + (" +dec" if decodes else "")


class StepRecorder:
    """Wraps a live EngineCore's executor to keep each submitted micro-batch's shape."""

    def __init__(self) -> None:
        self.shapes: dict[int, tuple[list[tuple[int, int]], BatchShape]] = {}
        self.core: Any = None

    def __call__(self, core: Any) -> None:
        self.core = core
        submit = core.executor.submit

        def recording_submit(scheduler_output: SchedulerOutput):
            chunks = [
                (r.num_computed_tokens, r.num_scheduled_tokens) for r in scheduler_output.requests
            ]
            self.shapes[scheduler_output.micro_batch_id] = (chunks, BatchShape.of(scheduler_output))
            return submit(scheduler_output)

        core.executor.submit = recording_submit

    def steps(self, profile_path: str) -> list[Step]:
        config: EngineConfig = self.core.config
        profile = load_profile(profile_path)
        costs = profile.stage_costs(
            config.model_config.hf_config_kwargs(), config.pipeline_parallel_size
        )
        steps = []
        for record in self.core.pipeline_stats.records:
            chunks, batch = self.shapes[record.micro_batch_id]
            steps.append(
                Step(
                    kind_of(chunks),
                    chunks,
                    batch,
                    [end - start for start, end in record.stage_times],
                    [cost.seconds(batch) for cost in costs],
                )
            )
        return steps


def summarize(steps: list[Step]) -> list[dict[str, Any]]:
    """Per kind and stage: count, measured and predicted seconds in all, median ratio."""
    by_kind: dict[str, list[Step]] = defaultdict(list)
    for step in steps:
        by_kind[step.kind].append(step)
    total = sum(sum(s.measured_s) for s in steps)
    rows = []

    def stage_seconds(group: list[Step]) -> float:
        return sum(sum(s.measured_s) for s in group)

    for kind, group in sorted(by_kind.items(), key=lambda kv: -stage_seconds(kv[1])):
        for stage in range(len(group[0].measured_s)):
            measured = sum(s.measured_s[stage] for s in group)
            predicted = sum(s.predicted_s[stage] for s in group)
            ratios = [s.measured_s[stage] / s.predicted_s[stage] for s in group]
            rows.append(
                {
                    "kind": kind,
                    "stage": stage,
                    "count": len(group),
                    "mean_tokens": statistics.mean(s.batch.num_tokens for s in group),
                    "mean_context": statistics.mean(s.batch.context_tokens for s in group),
                    "measured_s": measured,
                    "predicted_s": predicted,
                    "share": stage_seconds(group) / total,
                    "median_ratio": statistics.median(ratios),
                }
            )
    return rows


def print_summary(rows: list[dict[str, Any]], steps: list[Step]) -> None:
    print(f"{'kind':18s} {'stage':>5s} {'n':>4s} {'tokens':>7s} {'context':>8s} "
          f"{'measured s':>10s} {'predicted s':>11s} {'meas/pred':>9s} {'median':>7s} "
          f"{'share':>6s}")  # fmt: skip
    for r in rows:
        print(
            f"{r['kind']:18s} {r['stage']:5d} {r['count']:4d} {r['mean_tokens']:7.1f} "
            f"{r['mean_context']:8.0f} {r['measured_s']:10.2f} {r['predicted_s']:11.2f} "
            f"{r['measured_s'] / r['predicted_s']:9.2f} {r['median_ratio']:7.2f} "
            f"{r['share']:6.1%}"
        )
    measured = sum(sum(s.measured_s) for s in steps)
    predicted = sum(sum(s.predicted_s) for s in steps)
    print(f"all stage steps: measured {measured:.2f} s, predicted {predicted:.2f} s, "
          f"ratio {measured / predicted:.3f}")  # fmt: skip


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
        "kind of micro-batch (decode xR, chunk, tail, prompts xN)",
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
            # took meanwhile (a lock keeps other benchmarks out, not everything).
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
