"""Pipeline stats: busy and bubble fractions from stage times; trace and timeline output."""

import json

import pytest

from pipellm.bench.timeline import load_slices, render_timeline
from pipellm.engine.pipeline_stats import MicroBatchRecord, PipelineStats


def stats_with(records: list[MicroBatchRecord]) -> PipelineStats:
    stats = PipelineStats(num_stages=2)
    stats.records = records
    return stats


def test_busy_and_idle_fractions_over_active_time():
    # Two micro-batches through two stages, perfectly overlapped, then an idle gap, then one
    # more micro-batch that leaves each stage idle while the other works.
    records = [
        MicroBatchRecord(0, 0.0, 2.0, 4, 100, 1, [(0.0, 1.0), (1.0, 2.0)]),
        MicroBatchRecord(1, 0.0, 3.0, 4, 100, 2, [(1.0, 2.0), (2.0, 3.0)]),
        MicroBatchRecord(2, 10.0, 12.0, 2, 50, 1, [(10.0, 11.0), (11.0, 12.0)]),
    ]
    summary = stats_with(records).summary()
    # Active time: [0, 3] and [10, 12] = 5 s; the idle gap between requests does not count.
    assert summary["active_s"] == pytest.approx(5.0)
    assert summary["stage_busy_s"] == pytest.approx([3.0, 3.0])
    assert summary["stage_idle_fraction"] == pytest.approx([0.4, 0.4])
    assert summary["max_queue_depth"] == 2
    assert summary["mean_requests_per_micro_batch"] == pytest.approx(10 / 3)
    assert stats_with(records).summary(since=5.0)["stage_idle_fraction"] == pytest.approx(
        [0.5, 0.5]
    )


def test_trace_has_one_lane_per_stage_and_renders(tmp_path):
    records = [
        MicroBatchRecord(i, i * 1.0, i + 2.0, 1, 10, 2, [(i, i + 1.0), (i + 1.0, i + 2.0)])
        for i in range(3)
    ]
    trace = tmp_path / "t.json"
    stats_with(records).write_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}
    lanes = load_slices(trace)
    assert [round(s, 6) for s, _, _ in lanes[1]] == [1.0, 2.0, 3.0]
    png = tmp_path / "t.png"
    render_timeline(trace, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
