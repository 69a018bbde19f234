"""The hand-over costs of a real pipeline, from its micro-batches' timestamps.

A micro-batch's record: when the engine submitted it, each stage's (start, end) as the stage
reported it (ModelOutput.stage_times; a stage starts when its inputs are here), and when its
result reached the engine. With mp every stage is a process on the same host, so all of these
are one clock (time.time()).

Rule (docs/simulation.md, "Measured profiles"): a gap counts only the time nothing but the
hand-over held the micro-batch, so a stage still busy with the micro-batch before it is not
counted (the simulator adds that queueing itself: a step starts at max(arrival, stage free)):

    link gap (stage k -> k+1) = start[k+1] - max(end[k], end[k+1] of the previous micro-batch)
    dispatch gap = (start[0] - max(submitted, end[0] of the previous micro-batch))
                   + (result - end[last])

link.latency_s is the median link gap over every boundary and micro-batch, dispatch_s the
median dispatch gap (medians: one descheduled process must not set the figure).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatchRecord:
    submitted: float
    stage_times: list[tuple[float, float]]
    resulted: float


@dataclass(frozen=True)
class HandOver:
    latency_s: float  # link.latency_s: one stage's end -> the next stage's start
    dispatch_s: float  # link.dispatch_s: the engine's submit -> stage 0, last stage -> engine


def link_gaps(records: list[MicroBatchRecord]) -> list[float]:
    """Every boundary's gap of every micro-batch (records in submission order)."""
    gaps = []
    for index, record in enumerate(records):
        previous = records[index - 1].stage_times if index else None
        for stage in range(1, len(record.stage_times)):
            ready = record.stage_times[stage - 1][1]
            free = previous[stage][1] if previous else ready
            gaps.append(record.stage_times[stage][0] - max(ready, free))
    return gaps


def dispatch_gaps(records: list[MicroBatchRecord]) -> list[float]:
    gaps = []
    for index, record in enumerate(records):
        free = records[index - 1].stage_times[0][1] if index else record.submitted
        to_first = record.stage_times[0][0] - max(record.submitted, free)
        gaps.append(to_first + record.resulted - record.stage_times[-1][1])
    return gaps


def hand_over(records: list[MicroBatchRecord]) -> HandOver:
    """Medians of the gaps; a single stage has no link (latency 0)."""
    if not records:
        raise ValueError("no micro-batch records to measure the hand-over from")
    links = link_gaps(records)
    return HandOver(
        latency_s=max(0.0, statistics.median(links)) if links else 0.0,
        dispatch_s=max(0.0, statistics.median(dispatch_gaps(records))),
    )
