"""Prometheus metrics for one app, in its own registry (two apps in one process must not share counters).

Request and token counts are updated by the handlers; engine gauges are read from the AsyncEngine's stats
snapshot at scrape time, so a scrape never waits for a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Label values of mlaserve_requests_total, set by whoever ends a request.
STATUSES = ("ok", "aborted", "timeout", "error", "rejected", "throttled", "unavailable", "unauthorized")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    """Engine gauges from a stats snapshot; preemptions and prefix-cache counts are monotonic counters."""

    def __init__(
        self, stats: Callable[[], dict], alive: Callable[[], bool], in_flight: Callable[[], int]
    ) -> None:
        self._stats, self._alive, self._in_flight = stats, alive, in_flight

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        gauges = (
            ("num_requests_running", "Engine requests being stepped", s.get("num_running", 0)),
            (
                "num_requests_waiting",
                "Engine requests queued for KV space or a batch slot",
                s.get("num_waiting", 0),
            ),
            ("kv_blocks_used", "KV-cache blocks in use", s.get("kv_blocks_used", 0)),
            ("kv_blocks_total", "KV-cache blocks in the pool", s.get("kv_blocks_total", 0)),
            (
                "prefix_cache_hit_rate",
                "Prefix-cache hits / queries since start",
                s.get("prefix_cache_hit_rate", 0.0),
            ),
            ("kv_bytes_per_token", "KV-cache bytes per token, all layers", s.get("kv_bytes_per_token", 0)),
            ("engine_alive", "1 while the engine loop runs", 1.0 if self._alive() else 0.0),
            ("http_requests_in_flight", "Generation requests being served", self._in_flight()),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"mlaserve_{name}", doc, value=float(value))
        counters = (
            ("num_preemptions", "Requests preempted for KV space", s.get("num_preemptions", 0)),
            ("prefix_cache_queries", "Prefix-cache lookups", s.get("prefix_cache_queries", 0)),
            ("prefix_cache_hits", "Prefix-cache hits", s.get("prefix_cache_hits", 0)),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"mlaserve_{name}", doc, value=float(value))


class ServerMetrics:
    def __init__(
        self, stats: Callable[[], dict], alive: Callable[[], bool], in_flight: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "mlaserve_requests", "Generation requests by how they ended", ["status"], registry=self.registry
        )
        for status in STATUSES:  # present at 0, so dashboards and alerts see the series from the start
            self.requests.labels(status)
        self.prompt_tokens = Counter(
            "mlaserve_prompt_tokens", "Prompt tokens admitted", registry=self.registry
        )
        self.generation_tokens = Counter(
            "mlaserve_generation_tokens", "Tokens generated and delivered", registry=self.registry
        )
        self.ttft = Histogram(
            "mlaserve_time_to_first_token_seconds",
            "From request arrival to its first generated token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "mlaserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one choice",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "mlaserve_request_latency_seconds",
            "From request arrival to its end",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats, alive, in_flight))

    def count(self, status: str) -> None:
        self.requests.labels(status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
