"""Serving benchmark figures from per-request timestamps (definitions in docs/bench_serve.md)."""

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Latency families, as named in result keys, in the order the table prints them.
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestTiming:
    """What one request did, as absolute time.perf_counter() timestamps."""

    prompt_len: int
    start_time: float = 0.0
    end_time: float = 0.0
    # Arrival of every streamed chunk that carried output text.
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    success: bool = False
    error: str = ""

    @property
    def latency(self) -> float:
        """End-to-end latency: sent -> response complete."""
        return self.end_time - self.start_time

    @property
    def ttft(self) -> float:
        """Sent -> first output chunk (-> response complete if no chunk carried text)."""
        first = self.chunk_times[0] if self.chunk_times else self.end_time
        return first - self.start_time

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive output chunks."""
        return np.diff(self.chunk_times).tolist()

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for single-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def summarize(values_s: list[float], name: str, percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/pN of values given in seconds, as f"{stat}_{name}_ms" keys (0 if empty)."""
    values_ms = np.asarray(values_s, dtype=float) * 1000
    empty = values_ms.size == 0
    summary = {
        f"mean_{name}_ms": 0.0 if empty else float(np.mean(values_ms)),
        f"median_{name}_ms": 0.0 if empty else float(np.median(values_ms)),
        f"std_{name}_ms": 0.0 if empty else float(np.std(values_ms)),
    }
    for p in percentiles:
        value = 0.0 if empty else float(np.percentile(values_ms, p))
        summary[f"p{percentile_label(p)}_{name}_ms"] = value
    return summary


def percentile_label(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (the form used in result keys and table rows)."""
    return str(int(p)) if p == int(p) else str(p)


def peak_concurrency(intervals: list[tuple[float, float]]) -> int:
    """Most intervals [start, end] open at one instant; an end at a start's instant counts first."""
    # Sorting (time, delta) puts -1 (an end) before +1 (a start) at equal times.
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    return peak


def output_tokens_per_second(outputs: list[RequestTiming], benchmark_start: float) -> list[float]:
    """Output tokens per 1-second bucket since benchmark_start, by chunk arrival time.

    A request's tokens are spread evenly over its text chunks, so a server that sends several
    tokens per chunk still adds up to its usage count.
    """
    buckets: list[float] = []
    for out in outputs:
        if not out.success or not out.chunk_times:
            continue
        tokens_per_chunk = out.output_tokens / len(out.chunk_times)
        for t in out.chunk_times:
            bucket = math.floor(t - benchmark_start)
            buckets.extend([0.0] * (bucket + 1 - len(buckets)))
            buckets[bucket] += tokens_per_chunk
    return buckets


def compute_metrics(
    outputs: list[RequestTiming],
    benchmark_start: float,
    duration: float,
    percentiles: list[float],
) -> dict[str, Any]:
    """Every aggregate figure of a run, keyed as in the familiar tool's result files."""
    done = [out for out in outputs if out.success]
    total_input = sum(out.prompt_len for out in done)
    total_output = sum(out.output_tokens for out in done)
    per_second = output_tokens_per_second(outputs, benchmark_start)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": max(per_second, default=0.0),
        # Failed requests occupied the server too, so every request counts here.
        "max_concurrent_requests": peak_concurrency(
            [(out.start_time, out.end_time) for out in outputs]
        ),
    }
    values = {
        "ttft": [out.ttft for out in done],
        "tpot": [out.tpot for out in done if out.tpot is not None],
        "itl": [gap for out in done for gap in out.itl],
        "e2el": [out.latency for out in done],
    }
    for name in METRICS:
        result.update(summarize(values[name], name, percentiles))
    return result
