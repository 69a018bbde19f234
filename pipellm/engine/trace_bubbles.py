"""Why each pipeline stage sat idle, from a trace written with --trace-file.

Every gap between two micro-batches on a stage is one of two kinds:
- overhead: the stage's input was already there when it became free (transfer, input
  preparation; on stage 0 the delivery of the engine's micro-batch) - the pipeline
  machinery's own cost;
- waiting: the input was not ready yet - the previous stage was still computing it, or, on
  stage 0, the engine had not submitted it. This is the pipeline bubble: imbalance, filling,
  draining.
Stage 0's waiting is split further (traces that record when each output reached the engine):
the engine submits a micro-batch only after it applied the output of an earlier one (the
batch queue was full, or the next micro-batch needed that output), so the wait is
  on later stages: until the last stage finished that earlier micro-batch,
  return: its output's way from the last stage to the engine,
  engine: applying the output and scheduling the next micro-batch.
Usage: pipellm trace bubbles TRACE.json
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StageGaps:
    busy_s: float
    overhead_s: float
    waiting_s: float
    span_s: float  # first start to last end over all stages
    # Stage 0's waiting_s split (0 on other stages, and on traces without done times):
    on_later_stages_s: float = 0.0
    return_s: float = 0.0
    engine_s: float = 0.0


def _overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def stage_gaps(trace_path: str | Path) -> list[StageGaps]:
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e["ph"] == "X"]
    lanes = sorted({e["tid"] for e in events})
    last_stage = lanes[-1]
    spans: dict[tuple[int, int], tuple[float, float]] = {}
    submitted: dict[int, float] = {}
    done: dict[int, float] = {}
    for e in events:
        step = int(e["name"].split()[-1])
        spans[(step, e["tid"])] = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        submitted[step] = e["args"]["submitted_us"] / 1e6
        if "done_us" in e["args"]:
            done[step] = e["args"]["done_us"] / 1e6
    by_done = sorted((t, step) for step, t in done.items())
    done_times = [t for t, _ in by_done]
    first = min(start for start, _ in spans.values())
    last = max(end for _, end in spans.values())
    result = []
    for stage in lanes:
        steps = sorted(step for step, s in spans if s == stage)
        busy = sum(spans[(step, stage)][1] - spans[(step, stage)][0] for step in steps)
        gaps = StageGaps(busy, 0.0, 0.0, last - first)
        for previous, step in itertools.pairwise(steps):
            free, start = spans[(previous, stage)][1], spans[(step, stage)][0]
            if start <= free:
                continue
            ready = spans[(step, stage - 1)][1] if stage > 0 else submitted[step]
            gaps.overhead_s += max(0.0, start - max(free, ready))
            waited_until = min(ready, start)
            gaps.waiting_s += max(0.0, waited_until - free)
            if stage > 0 or not done or waited_until <= free:
                continue
            # The output the engine applied last before submitting this micro-batch.
            index = bisect.bisect_right(done_times, submitted[step]) - 1
            if index < 0:
                gaps.engine_s += waited_until - free
                continue
            earlier_done, earlier = by_done[index]
            finished = spans[(earlier, last_stage)][1]
            gaps.on_later_stages_s += _overlap(free, finished, free, waited_until)
            gaps.return_s += _overlap(finished, earlier_done, free, waited_until)
            gaps.engine_s += _overlap(max(free, earlier_done), waited_until, free, waited_until)
        result.append(gaps)
    return result


def print_stage_gaps(trace_path: str | Path) -> None:
    """`pipellm trace bubbles`: each stage's busy, waiting and overhead share of the span."""
    for stage, gaps in enumerate(stage_gaps(trace_path)):
        span = gaps.span_s or 1.0
        print(
            f"stage {stage}: busy {gaps.busy_s:7.2f} s ({gaps.busy_s / span:.0%})  "
            f"waiting {gaps.waiting_s:6.2f} s ({gaps.waiting_s / span:.1%})  "
            f"overhead {gaps.overhead_s:6.2f} s ({gaps.overhead_s / span:.1%})"
        )
        split = gaps.on_later_stages_s + gaps.return_s + gaps.engine_s
        if split > 0:
            print(
                f"  waiting: on later stages {gaps.on_later_stages_s / span:.1%}, "
                f"return to the engine {gaps.return_s / span:.1%}, "
                f"engine (apply + schedule) {gaps.engine_s / span:.1%}"
            )
