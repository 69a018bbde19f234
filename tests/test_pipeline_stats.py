"""Pipeline stats: busy and bubble fractions from stage times; trace and timeline output."""

import importlib.util
import json

import pytest

from pipellm.engine.pipeline_stats import MicroBatchRecord, PipelineStats
from pipellm.engine.trace_bubbles import stage_gaps
from pipellm.engine.trace_timeline import load_slices
from pipellm.entrypoints import cli


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


def test_running_totals_keep_counting_past_the_kept_records():
    clock = iter([0.0, 0.5, 2.0, 3.0, 10.0, 12.0])
    stats = PipelineStats(num_stages=2, max_records=2, clock=lambda: next(clock))
    stats.on_submit(0, 1, 10, 1)
    stats.on_submit(1, 1, 10, 2)
    stats.on_done(0, [(0.0, 1.0), (1.0, 2.0)])
    stats.on_done(1, [(1.0, 2.0), (2.0, 3.0)])
    stats.on_submit(2, 1, 10, 1)
    stats.on_done(2, [(10.0, 11.0), (11.0, 11.5)])
    assert [r.micro_batch_id for r in stats.records] == [1, 2], "the newest records are kept"
    assert stats.active_total == pytest.approx(5.0)  # [0, 3] and [10, 12]
    assert stats.stage_busy_total == pytest.approx([3.0, 2.5])
    assert stats.summary(since=5.0)["stage_busy_s"] == pytest.approx([1.0, 0.5])


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
    cli.main(["trace", "timeline", str(trace), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pngs_without_matplotlib_name_the_extra(tmp_path, monkeypatch, capsys):
    """--plot, the timeline and the demo say which extra to install, before any work."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    png = tmp_path / "t.png"
    for argv in (
        ["trace", "timeline", str(tmp_path / "absent.json"), str(png)],
        ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", str(png)],
        ["demo"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        assert "pip install 'pipellm[plot]'" in capsys.readouterr().err
    assert not png.exists()


def test_bubbles_tell_waiting_on_the_other_stage_from_overhead(tmp_path, capsys):
    records = [
        MicroBatchRecord(0, 0.0, 3.0, 1, 10, 1, [(0.0, 1.0), (1.05, 3.0)]),
        MicroBatchRecord(1, 0.0, 3.5, 1, 10, 2, [(1.0, 2.0), (3.0, 3.5)]),
        # Stage 0 waits for micro-batch 0 to come back (queue depth 2), then 0.1 s overhead;
        # stage 1 then waits for stage 0 and starts 0.02 s after its input is ready.
        MicroBatchRecord(2, 3.0, 5.0, 1, 10, 2, [(3.1, 4.0), (4.02, 5.0)]),
    ]
    trace = tmp_path / "t.json"
    stats_with(records).write_trace(str(trace))
    first, second = stage_gaps(trace)
    cli.main(["trace", "bubbles", str(trace)])  # the same figures, as `pipellm trace` prints them
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("stage 0: busy    2.90 s (58%)  waiting   1.00 s (20.0%)")
    assert printed[-1].startswith("stage 1: busy    3.43 s")
    assert first.busy_s == pytest.approx(2.9) and second.busy_s == pytest.approx(3.43)
    assert first.waiting_s == pytest.approx(1.0) and first.overhead_s == pytest.approx(0.1)
    assert second.waiting_s == pytest.approx(0.5) and second.overhead_s == pytest.approx(0.02)
    assert first.span_s == pytest.approx(5.0)


def test_bubbles_split_stage_0_waiting_into_later_stages_return_and_engine(tmp_path):
    records = [
        # Micro-batch 0 leaves the last stage at 3.0 and reaches the engine at 3.2.
        MicroBatchRecord(0, 0.0, 3.2, 1, 10, 1, [(0.0, 1.0), (1.05, 3.0)]),
        MicroBatchRecord(1, 0.0, 3.7, 1, 10, 2, [(1.0, 2.0), (3.0, 3.5)]),
        # The engine submits micro-batch 2 at 3.3 (0.1 s applying and scheduling); stage 0,
        # free since 2.0, starts it at 3.4: waited 1.0 on stage 1, 0.2 on the return, 0.1 on
        # the engine, then 0.1 s delivery overhead.
        MicroBatchRecord(2, 3.3, 5.5, 1, 10, 2, [(3.4, 4.0), (4.02, 5.0)]),
    ]
    trace = tmp_path / "t.json"
    stats_with(records).write_trace(str(trace))
    first, second = stage_gaps(trace)
    assert first.waiting_s == pytest.approx(1.3) and first.overhead_s == pytest.approx(0.1)
    assert first.on_later_stages_s == pytest.approx(1.0)
    assert first.return_s == pytest.approx(0.2)
    assert first.engine_s == pytest.approx(0.1)
    assert second.on_later_stages_s == second.return_s == second.engine_s == 0.0
