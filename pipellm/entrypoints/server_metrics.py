"""Prometheus metrics of the API server: request latencies measured here, engine state from
the engine core's stats snapshot taken at scrape time."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipellm.protocol import EngineOutput, EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class EngineStatsCollector(Collector):
    """Turns the latest EngineCore.stats() snapshot into gauges and counters."""

    def __init__(self, model_name: str, num_stages: int) -> None:
        self.model_name = model_name
        self.num_stages = num_stages
        self.stats: EngineStats | None = None  # None: the engine did not answer (dead)

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        gauges = (
            ("num_requests_running", "Requests in the running set.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks held by requests (1 = full).",
                stats.kv_cache_usage,
            ),
            (
                "num_micro_batches_in_flight",
                "Micro-batches submitted to the pipeline and not yet returned.",
                stats.num_in_flight,
            ),
        )
        for name, help_text, value in gauges:
            yield self._gauge(name, help_text, value)
        counters = (
            ("prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens_total),
            ("generation_tokens", "Tokens generated.", stats.generation_tokens_total),
            ("num_preemptions", "Requests preempted for KV-cache space.", stats.num_preemptions),
            (
                "pipeline_active_seconds",
                "Time the engine had work in flight (rate() it against stage_busy_seconds).",
                stats.pipeline_active_seconds_total,
            ),
        )
        for name, help_text, value in counters:
            counter = CounterMetricFamily(f"pipellm:{name}", help_text, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        busy_seconds = CounterMetricFamily(
            "pipellm:stage_busy_seconds",
            "Time each pipeline stage spent computing micro-batches.",
            labels=["model_name", "stage"],
        )
        for stage, seconds in enumerate(stats.stage_busy_seconds_total):
            busy_seconds.add_metric([self.model_name, str(stage)], seconds)
        yield busy_seconds
        busy = stats.pipeline.get("stage_busy_fraction", [0.0] * self.num_stages)
        stage_busy = GaugeMetricFamily(
            "pipellm:stage_busy_fraction",
            "Fraction of the time the engine had work in flight that each pipeline stage was "
            "computing, over the last minute.",
            labels=["model_name", "stage"],
        )
        for stage, fraction in enumerate(busy):
            stage_busy.add_metric([self.model_name, str(stage)], fraction)
        yield stage_busy

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(f"pipellm:{name}", help_text, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge


class ServerMetrics:
    """Every metric of one server, in its own registry."""

    def __init__(self, model_name: str, num_stages: int) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector(model_name, num_stages)
        self.registry.register(self.engine)
        self.ttft = self._histogram(
            "time_to_first_token_seconds", "Request arrival to its first token.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Gap between consecutive tokens of a request.",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "Request arrival to its last token.", E2E_BUCKETS
        )
        self._finished = Counter(
            "pipellm:request_success",
            "Requests finished, by reason (stop, length).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def _histogram(self, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
        histogram = Histogram(
            f"pipellm:{name}", help_text, ["model_name"], buckets=buckets, registry=self.registry
        )
        return histogram.labels(self.model_name)

    async def track(
        self, outputs: AsyncIterator[EngineOutput], arrival: float
    ) -> AsyncIterator[EngineOutput]:
        """Passes outputs through, timing them; arrival is a time.perf_counter()."""
        last: float | None = None
        async with aclosing(outputs):  # closing this closes the request's stream (abort)
            async for output in outputs:
                now = time.perf_counter()
                if last is None:
                    self.ttft.observe(now - arrival)
                else:
                    self.itl.observe(now - last)
                last = now
                if output.finished:
                    self.e2e.observe(now - arrival)
                    self._finished.labels(self.model_name, output.finish_reason).inc()
                yield output

    def render(self, stats: EngineStats | None) -> bytes:
        """The Prometheus text exposition, with the engine state of `stats`."""
        self.engine.stats = stats
        return generate_latest(self.registry)
