"""The serving benchmark's printed table and its JSON result file."""

import json
import os
from typing import Any

from pipellm.bench.metrics import METRICS, percentile_label

TABLE_WIDTH = 50
LABEL_WIDTH = 40
VALUE_WIDTH = 10

# Section title and row abbreviation of each latency family.
SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(label: str, value: float | int, decimals: int | None = None) -> str:
    """A table row; decimals=None prints an integer."""
    text = f"{value}" if decimals is None else f"{value:.{decimals}f}"
    return f"{label:<{LABEL_WIDTH}} {text:<{VALUE_WIDTH}}"


def format_table(
    result: dict[str, Any],
    max_concurrency: int | None,
    selected_metrics: list[str],
    percentiles: list[float],
) -> str:
    """The result table, row for row in the familiar tool's layout."""
    lines = [
        f"{' Serving Benchmark Result ':=^{TABLE_WIDTH}}",
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    lines += [
        _row("Benchmark duration (s):", result["duration"], 2),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", result["request_throughput"], 2),
        _row("Output token throughput (tok/s):", result["output_throughput"], 2),
        _row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], 2),
        _row("Peak concurrent requests:", result["max_concurrent_requests"], 2),
        _row("Total Token throughput (tok/s):", result["total_token_throughput"], 2),
    ]
    for name in METRICS:
        if name not in selected_metrics:
            continue
        title, abbrev = SECTIONS[name]
        lines.append(f"{title:-^{TABLE_WIDTH}}")
        lines.append(_row(f"Mean {abbrev} (ms):", result[f"mean_{name}_ms"], 2))
        lines.append(_row(f"Median {abbrev} (ms):", result[f"median_{name}_ms"], 2))
        for p in percentiles:
            label = percentile_label(p)
            lines.append(_row(f"P{label} {abbrev} (ms):", result[f"p{label}_{name}_ms"], 2))
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


def save_result(result: dict[str, Any], result_dir: str | None, filename: str) -> str:
    """Write result as JSON into result_dir (default: the current directory); returns the path."""
    path = os.path.join(result_dir or ".", filename)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path
