"""Why each pipeline stage sat idle, from a trace written with --trace-file.

Every gap between two micro-batches on a stage is one of two kinds:
- overhead: the stage's input was already there when it became free (transfer, the engine's
  loop, input preparation) - the pipeline machinery's own cost;
- waiting: the input was not ready yet - the previous stage was still computing it, or, on
  stage 0, the micro-batch P places back had not returned (the batch queue was full). This is
  the pipeline bubble: imbalance, filling and draining.
Usage: python -m pipellm.bench.bubbles TRACE.json
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path

from pipellm.bench.timeline import load_slices


@dataclass
class StageGaps:
    busy_s: float
    overhead_s: float
    waiting_s: float
    span_s: float  # first start to last end over all stages


def stage_gaps(trace_path: str | Path) -> list[StageGaps]:
    lanes = load_slices(trace_path)
    num_stages = len(lanes)
    spans: dict[tuple[int, int], tuple[float, float]] = {}
    for stage, lane in lanes.items():
        for start, duration, name in lane:
            spans[(int(name.split()[-1]), stage)] = (start, start + duration)
    first = min(start for start, _ in spans.values())
    last = max(end for _, end in spans.values())
    result = []
    for stage in sorted(lanes):
        steps = sorted(step for step, s in spans if s == stage)
        busy = sum(end - start for step in steps for start, end in [spans[(step, stage)]])
        overhead = waiting = 0.0
        for previous, step in itertools.pairwise(steps):
            free, start = spans[(previous, stage)][1], spans[(step, stage)][0]
            if start <= free:
                continue
            source = (step, stage - 1) if stage > 0 else (step - num_stages, num_stages - 1)
            ready = spans[source][1] if source in spans else free
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
