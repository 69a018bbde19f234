"""Serving benchmark math on synthetic timestamps, the printed table and the result file."""

import json
import math

import numpy as np
import pytest

from pipellm.bench.metrics import (
    RequestTiming,
    compute_metrics,
    output_tokens_per_second,
    peak_concurrency,
    summarize,
)
from pipellm.bench.report import format_table, save_result

START = 100.0  # benchmark start; every time below is exact in binary floating point


def _run() -> list[RequestTiming]:
    """Three finished requests and one failure, hand-timed."""
    return [
        RequestTiming(10, 100.0, 101.25, [100.5, 100.75, 101.0, 101.25], 4, "abcd", True),
        RequestTiming(6, 100.25, 101.75, [101.0, 101.5], 2, "ef", True),
        # Starts at the instant the request above ends.
        RequestTiming(8, 101.75, 102.0, [], 0, "", False, "HTTP 500: boom"),
        RequestTiming(4, 101.0, 101.5, [101.5], 1, "g", True),
    ]


def test_request_timings() -> None:
    first = _run()[0]
    assert (first.ttft, first.latency, first.itl, first.tpot) == (0.5, 1.25, [0.25] * 3, 0.25)
    assert _run()[3].tpot is None  # one token: no time per output token
    assert RequestTiming(1, 5.0, 5.5, [], 1, success=True).ttft == 0.5


def test_compute_metrics_by_hand() -> None:
    result = compute_metrics(_run(), START, duration=2.0, percentiles=[50, 75, 100])
    expected = {
        "duration": 2.0,
        "completed": 3,
        "failed": 1,
        "total_input_tokens": 10 + 6 + 4,
        "total_output_tokens": 4 + 2 + 1,
        "request_throughput": 3 / 2,
        "output_throughput": 7 / 2,
        "total_token_throughput": 27 / 2,
        # Second 0: two chunks of the first request; second 1: the other five.
        "max_output_tokens_per_s": 5.0,
        # At 101.0 three requests are open; at 101.75 an end and a start meet and don't overlap.
        "max_concurrent_requests": 3,
        # TTFTs 500, 750, 500 ms.
        "mean_ttft_ms": 1750 / 3,
        "median_ttft_ms": 500.0,
        "std_ttft_ms": math.sqrt(((500 - 1750 / 3) ** 2 * 2 + (750 - 1750 / 3) ** 2) / 3),
        "p50_ttft_ms": 500.0,
        "p75_ttft_ms": 625.0,
        "p100_ttft_ms": 750.0,
        # TPOTs: (1250 - 500) / 3 and (1500 - 750) / 1; the one-token request has none.
        "mean_tpot_ms": 500.0,
        "median_tpot_ms": 500.0,
        "std_tpot_ms": 250.0,
        "p50_tpot_ms": 500.0,
        "p75_tpot_ms": 625.0,
        "p100_tpot_ms": 750.0,
        # ITLs 250, 250, 250 (first request), 500 (second).
        "mean_itl_ms": 312.5,
        "median_itl_ms": 250.0,
        "std_itl_ms": math.sqrt((62.5**2 * 3 + 187.5**2) / 4),
        "p50_itl_ms": 250.0,
        "p75_itl_ms": 312.5,
        "p100_itl_ms": 500.0,
        # End-to-end 1250, 1500, 500.
        "mean_e2el_ms": 3250 / 3,
        "median_e2el_ms": 1250.0,
        "std_e2el_ms": float(np.std([1250.0, 1500.0, 500.0])),
        "p50_e2el_ms": 1250.0,
        "p75_e2el_ms": 1375.0,
        "p100_e2el_ms": 1500.0,
    }
    assert result.keys() == expected.keys()
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-12, abs=0), key


def test_all_failed_gives_zeros() -> None:
    result = compute_metrics([_run()[2]], START, duration=1.0, percentiles=[99])
    assert (result["completed"], result["failed"], result["max_output_tokens_per_s"]) == (0, 1, 0)
    assert result["mean_ttft_ms"] == result["p99_itl_ms"] == 0.0


@pytest.mark.parametrize(
    "intervals, peak",
    [
        ([], 0),
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], 1),  # touching: an end counts before a start
        ([(0.0, 3.0), (1.0, 2.0), (1.5, 4.0)], 3),
        ([(0.0, 1.0), (0.5, 1.5), (1.0, 2.0), (1.5, 2.5)], 2),
        ([(0.0, 1.0)] * 8, 8),
    ],
)
def test_peak_concurrency(intervals: list[tuple[float, float]], peak: int) -> None:
    assert peak_concurrency(intervals) == peak


def test_peak_concurrency_is_exact_where_per_second_buckets_overstate() -> None:
    # Concurrency 1, back to back, 0.5 s each: two requests touch every 1-s bucket.
    intervals = [(i * 0.5, (i + 1) * 0.5) for i in range(8)]
    assert peak_concurrency(intervals) == 1


def test_tokens_per_second_buckets_and_spreading() -> None:
    outputs = [
        RequestTiming(1, 0.0, 3.0, [0.25, 0.5, 2.5], 3, success=True),
        # Usage says 6 tokens over 2 chunks: 3 per chunk.
        RequestTiming(1, 0.0, 2.0, [1.0, 1.75], 6, success=True),
        RequestTiming(1, 0.0, 2.0, [1.0], 1, success=False, error="cut off"),
    ]
    assert output_tokens_per_second(outputs, benchmark_start=0.0) == [2.0, 6.0, 1.0]
    assert output_tokens_per_second(outputs, benchmark_start=-0.5) == [1.0, 4.0, 3.0, 1.0]


def test_summarize_names_percentiles_like_result_files() -> None:
    summary = summarize([0.001, 0.002, 0.003, 0.004], "itl", [99.9, 50])
    assert list(summary) == [
        "mean_itl_ms",
        "median_itl_ms",
        "std_itl_ms",
        "p99.9_itl_ms",
        "p50_itl_ms",
    ]
    assert summary["p50_itl_ms"] == summary["median_itl_ms"] == 2.5


# vLLM issue #27462's "mp backend, after" table, trailing spaces trimmed per line.
SEED_TABLE = """\
============ Serving Benchmark Result ============
Successful requests:                     256
Failed requests:                         0
Maximum request concurrency:             8
Benchmark duration (s):                  158.89
Total input tokens:                      1023744
Total generated tokens:                  8192
Request throughput (req/s):              1.61
Output token throughput (tok/s):         51.56
Peak output token throughput (tok/s):    176.00
Peak concurrent requests:                15.00
Total Token throughput (tok/s):          6494.74
---------------Time to First Token----------------
Mean TTFT (ms):                          2015.66
Median TTFT (ms):                        2041.88
P99 TTFT (ms):                           3430.10
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):                          95.11
Median TPOT (ms):                        94.66
P99 TPOT (ms):                           131.28
---------------Inter-token Latency----------------
Mean ITL (ms):                           95.11
Median ITL (ms):                         52.02
P99 ITL (ms):                            1222.23
=================================================="""

SEED_FIGURES = {
    "completed": 256,
    "failed": 0,
    "duration": 158.891,
    "total_input_tokens": 1023744,
    "total_output_tokens": 8192,
    "request_throughput": 1.6112,
    "output_throughput": 51.5555,
    "max_output_tokens_per_s": 176.0,
    "max_concurrent_requests": 15,
    "total_token_throughput": 6494.7444,
    "mean_ttft_ms": 2015.66,
    "median_ttft_ms": 2041.88,
    "p99_ttft_ms": 3430.1,
    "mean_tpot_ms": 95.11,
    "median_tpot_ms": 94.66,
    "p99_tpot_ms": 131.28,
    "mean_itl_ms": 95.11,
    "median_itl_ms": 52.02,
    "p99_itl_ms": 1222.23,
}


def test_table_matches_the_seed_row_for_row() -> None:
    table = format_table(SEED_FIGURES, 8, ["ttft", "tpot", "itl"], [99])
    assert [line.rstrip() for line in table.splitlines()] == SEED_TABLE.splitlines()
    for line in table.splitlines():
        # Titles and rules are 50 wide; rows are a 40-wide label, a space, a 10-wide value.
        assert len(line) == 50 if line[0] in "=-" else len(line) == 51, line


def test_table_sections_follow_the_selection() -> None:
    figures = compute_metrics(_run(), START, 2.0, [90, 99.9])
    table = format_table(figures, None, ["e2el", "ttft"], [90, 99.9])
    assert "Maximum request concurrency" not in table
    titles = [line.strip("-") for line in table.splitlines() if line.startswith("-")]
    assert titles == ["Time to First Token", "End-to-end Latency"]
    assert "P99.9 E2EL (ms):" in table and "P90 TTFT (ms):" in table


def test_save_result_writes_json(tmp_path) -> None:
    result = compute_metrics(_run(), START, 2.0, [99])
    path = save_result(result, str(tmp_path / "new_dir"), "run.json")
    saved = json.loads(open(path).read())
    assert saved == result
    for key in ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens"]:
        assert key in saved
    for key in ["request_throughput", "output_throughput", "total_token_throughput"]:
        assert key in saved
    assert "max_output_tokens_per_s" in saved and "max_concurrent_requests" in saved
    for metric in ["ttft", "tpot", "itl", "e2el"]:
        for stat in ["mean", "median", "std", "p99"]:
            assert f"{stat}_{metric}_ms" in saved
