"""Where pipeline time goes: per-stage busy time, bubbles, in-flight depth, micro-batch sizes.

Every micro-batch reports when each stage started and finished computing it. A stage's
*bubble* is the time it sat idle while the engine had work in flight (the union of all
micro-batches' submit-to-done intervals), so an idle server shows no bubbles.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class MicroBatchRecord:
    micro_batch_id: int
    submitted: float
    done: float
    num_requests: int
    num_tokens: int
    queue_depth: int  # micro-batches in flight right after this one was submitted
    stage_times: list[tuple[float, float]]
    # The most in-flight micro-batches holding one of this one's requests, it included: above
    # 1 when a prompt's chunks are in several at once (the chunked pipeline).
    request_spread: int = 1


class PipelineStats:
    def __init__(
        self,
        num_stages: int,
        max_records: int = 200_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.num_stages = num_stages
        self.clock = clock
        self.records: deque[MicroBatchRecord] = deque(maxlen=max_records)  # the newest
        self._submitted: dict[int, tuple[float, int, int, int, int]] = {}
        # Running totals since start, for counters (records only keep the newest).
        self.stage_busy_total = [0.0] * num_stages
        self.active_total = 0.0
        self._active_until = 0.0

    def on_submit(
        self, micro_batch_id: int, num_requests: int, num_tokens: int, depth: int, spread: int = 1
    ) -> None:
        self._submitted[micro_batch_id] = (self.clock(), num_requests, num_tokens, depth, spread)

    def on_done(self, micro_batch_id: int, stage_times: list[tuple[float, float]]) -> None:
        submitted, num_requests, num_tokens, depth, spread = self._submitted.pop(micro_batch_id)
        done = self.clock()
        self.records.append(
            MicroBatchRecord(
                micro_batch_id,
                submitted,
                done,
                num_requests,
                num_tokens,
                depth,
                stage_times,
                spread,
            )
        )
        for stage, (start, end) in enumerate(stage_times):
            self.stage_busy_total[stage] += end - start
        # Outputs come back in submission order, so the union of the in-flight intervals
        # grows at its end only.
        self.active_total += max(0.0, done - max(submitted, self._active_until))
        self._active_until = max(self._active_until, done)

    def summary(self, since: float = 0.0) -> dict[str, float | list[float]]:
        """Figures over the (kept) micro-batches submitted at or after `since` (a time.time())."""
        newest_first = itertools.takewhile(lambda r: r.submitted >= since, reversed(self.records))
        records = list(newest_first)[::-1]
        if not records:
            return {"num_micro_batches": 0}
        active = _union_length([(r.submitted, r.done) for r in records])
        busy = [0.0] * self.num_stages
        for r in records:
            for stage, (start, end) in enumerate(r.stage_times):
                busy[stage] += end - start
        busy_fraction = [min(1.0, b / active) if active > 0 else 0.0 for b in busy]
        return {
            "num_micro_batches": len(records),
            "active_s": active,
            "stage_busy_s": busy,
            "stage_busy_fraction": busy_fraction,
            "stage_idle_fraction": [1.0 - f for f in busy_fraction],
            "mean_queue_depth": sum(r.queue_depth for r in records) / len(records),
            "max_queue_depth": max(r.queue_depth for r in records),
            "mean_requests_per_micro_batch": sum(r.num_requests for r in records) / len(records),
            "mean_tokens_per_micro_batch": sum(r.num_tokens for r in records) / len(records),
            # One long prompt filling every stage shows as P here (the chunked pipeline).
            "max_micro_batches_per_request": max(r.request_spread for r in records),
            "fraction_sharing_a_request": sum(r.request_spread > 1 for r in records) / len(records),
        }

    def write_trace(self, path: str) -> None:
        """Chrome/Perfetto trace JSON: one lane per stage, one slice per micro-batch."""
        events: list[dict] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
            for s in range(self.num_stages)
        ]
        origin = min((r.submitted for r in self.records), default=0.0)
        for r in self.records:
            args = {
                "requests": r.num_requests,
                "tokens": r.num_tokens,
                "queue": r.queue_depth,
                "request_spread": r.request_spread,
                "submitted_us": (r.submitted - origin) * 1e6,  # when the engine sent it
                "done_us": (r.done - origin) * 1e6,  # when its output reached the engine
            }
            for stage, (start, end) in enumerate(r.stage_times):
                events.append(
                    {
                        "name": f"mb {r.micro_batch_id}",
                        "ph": "X",
                        "pid": 0,
                        "tid": stage,
                        "ts": (start - origin) * 1e6,
                        "dur": (end - start) * 1e6,
                        "args": args,
                    }
                )
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total
