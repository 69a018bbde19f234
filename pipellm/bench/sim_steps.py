"""Every real micro-batch's stage times against a profile's prediction, by kind of micro-batch.

A real run (pp_scaling's `run_once`, the mp backend) records each micro-batch's shape as the
engine submits it and each stage's measured compute time (`ModelOutput.stage_times`: the
stage's `worker.execute`, the same call `pipellm profile` times). The profile's cost model
predicts each from the shape alone; grouping the micro-batches by kind shows which shapes the
model gets wrong, and how much of each setup's stage time they are:

- `decode xR`: R decode rows and nothing else;
- `chunk`: one prompt chunk of more than 16 tokens (with `+dec` decode rows beside it);
- `tail`: a prompt's last few tokens (<= 16), alone or with decodes;
- `prompts xN`: N prompt chunks in one micro-batch (--no-pp-balance's whole prompts).

  .venv/bin/python -m pipellm.bench.sim_steps --profile P.json --setups c --concurrency 4
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipellm.bench.pp_scaling import SETUPS, run_once
from pipellm.config import EngineConfig
from pipellm.engine.microbatch_size import DEFAULT_MICROBATCH_TOKENS
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--setups", default="abc", help="pp_scaling's mp setups (a, b, c)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--pp-microbatch-tokens", type=int, default=DEFAULT_MICROBATCH_TOKENS)
    parser.add_argument("--out", help="write every micro-batch's figures to this JSON file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    dump = {}
    for setup in [s for s in SETUPS if s.label[0] in args.setups and s.label[0] in "abc"]:
        recorder = StepRecorder()
        start = cpu_counters()
        result = run_once(setup, args, None, on_core=recorder)
        foreign = other_processes_cpu(start)
        steps = recorder.steps(args.profile)
        print(
            f"\n{setup.label}, concurrency {args.concurrency}: duration "
            f"{result['duration_s']:.2f} s, other processes' CPU meanwhile {foreign:.1f} s"
        )
        print_summary(summarize(steps), steps)
        dump[setup.label] = [
            {
                "kind": s.kind,
                "chunks": s.chunks,
                "measured_s": s.measured_s,
                "predicted_s": s.predicted_s,
            }  # fmt: skip
            for s in steps
        ]
    if args.out:
        Path(args.out).write_text(json.dumps(dump))


if __name__ == "__main__":
    main()
