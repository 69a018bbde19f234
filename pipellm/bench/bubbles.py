"""Why each pipeline stage sat idle, from a trace written with --trace-file.

Every gap between two micro-batches on a stage is one of two kinds:
- overhead: the stage's input was already there when it became free (transfer, input
  preparation) - the pipeline machinery's own cost;
- waiting: the input was not ready yet - the previous stage was still computing it, or, on
  stage 0, the engine had not submitted it (the batch queue was full, or every runnable
  request was already in flight). This is the pipeline bubble: imbalance, filling, draining.
Usage: python -m pipellm.bench.bubbles TRACE.json
"""

from __future__ import annotations

import argparse
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


def stage_gaps(trace_path: str | Path) -> list[StageGaps]:
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e["ph"] == "X"]
    lanes = sorted({e["tid"] for e in events})
    spans: dict[tuple[int, int], tuple[float, float]] = {}
    submitted: dict[int, float] = {}
    for e in events:
        step = int(e["name"].split()[-1])
        spans[(step, e["tid"])] = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        submitted[step] = e["args"]["submitted_us"] / 1e6
    first = min(start for start, _ in spans.values())
    last = max(end for _, end in spans.values())
    result = []
    for stage in lanes:
        steps = sorted(step for step, s in spans if s == stage)
        busy = sum(spans[(step, stage)][1] - spans[(step, stage)][0] for step in steps)
        overhead = waiting = 0.0
        for previous, step in itertools.pairwise(steps):
            free, start = spans[(previous, stage)][1], spans[(step, stage)][0]
            if start <= free:
                continue
            ready = spans[(step, stage - 1)][1] if stage > 0 else submitted[step]
            overhead += max(0.0, start - max(free, ready))
            waiting += max(0.0, min(ready, start) - free)
        result.append(StageGaps(busy, overhead, waiting, last - first))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    args = parser.parse_args()
    for stage, gaps in enumerate(stage_gaps(args.trace)):
        span = gaps.span_s or 1.0
        print(
            f"stage {stage}: busy {gaps.busy_s:7.2f} s ({gaps.busy_s / span:.0%})  "
            f"waiting {gaps.waiting_s:6.2f} s ({gaps.waiting_s / span:.1%})  "
            f"overhead {gaps.overhead_s:6.2f} s ({gaps.overhead_s / span:.1%})"
        )


if __name__ == "__main__":
    main()
