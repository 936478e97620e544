"""Prometheus metrics for one app, in its own registry (two apps in one process must not share counters).

What mlaserve shares with vLLM carries vLLM's names, types, buckets and labels (`model_name`, `engine`), so a
vLLM dashboard or alert works unchanged: request counts by finish reason, token counters, latency histograms,
running/waiting gauges, KV-cache usage, prefix-cache and preemption counters. What only mlaserve measures keeps
an `mlaserve_` name: HTTP outcomes (throttled, timeout, unauthorized, ...), sequences in flight and connections
open (server-wide: the counts the limits hold), KV blocks and bytes per token, engine liveness. Engine gauges are
read from the AsyncEngine's stats snapshot at scrape time, so a scrape never waits for a step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlaserve.server.shared_count import ServerCounts

# Label values of mlaserve_requests_total, set by whoever ends a request.
STATUSES = ("ok", "aborted", "timeout", "error", "rejected", "throttled", "unavailable", "unauthorized")
FINISH_REASONS = ("stop", "length", "abort")
# Label values of mlaserve_http_connections_closed_total: why the connection limits closed a client's connection.
CLOSE_REASONS = ("evicted", "refused", "header_timeout")

# vLLM's buckets, so histogram quantiles computed over both engines agree.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineCollector(Collector):
    """Gauges and counters the engine keeps, read from a stats snapshot at scrape time."""

    def __init__(
        self,
        stats: Callable[[], dict],
        alive: Callable[[], bool],
        labels: dict[str, str],
    ) -> None:
        self._stats, self._alive, self._labels = stats, alive, labels

    def _gauge(
        self, name: str, doc: str, value: float, labels: dict[str, str] | None = None
    ) -> GaugeMetricFamily:
        labels = labels or self._labels
        family = GaugeMetricFamily(name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), float(value))
        return family

    def _per_position(self, counts: list[int]) -> CounterMetricFamily:
        """vLLM's accepted drafts by their place in the step's drafts: one sample per position, labelled."""
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*self._labels, "position"],
        )
        for position, count in enumerate(counts):
            family.add_metric([*self._labels.values(), str(position)], float(count))
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), float(value))
        return family

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        total = s.get("kv_blocks_total", 0)
        usage = s.get("kv_blocks_used", 0) / total if total else 0.0
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.get("num_running", 0),
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.get("num_waiting", 0),
        )
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        # The name vLLM used before kv_cache_usage_perc, which older dashboards still read.
        yield self._gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in queried tokens.",
            s.get("prefix_cache_queries", 0),
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", s.get("prefix_cache_hits", 0)
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", s.get("num_preemptions", 0)
        )
        if s.get("speculative_decoding"):
            yield self._counter(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.get("num_draft_tokens", 0)
            )
            yield self._counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                s.get("num_accepted_tokens", 0),
            )
            yield self._per_position(s.get("num_accepted_tokens_per_pos", []))
        info = {
            **self._labels,
            "block_size": str(s.get("block_size", "")),
            "cache_dtype": str(s.get("kv_cache_dtype", "")),
            "num_gpu_blocks": str(total),
            "enable_prefix_caching": str(s.get("enable_prefix_caching", "")),
        }
        yield self._gauge(
            "vllm:cache_config_info", "Information of the engine's KV-cache configuration.", 1, info
        )
        # Ours: no vLLM counterpart.
        mine = (
            ("kv_blocks_used", "KV-cache blocks in use", s.get("kv_blocks_used", 0)),
            ("kv_blocks_total", "KV-cache blocks in the pool", total),
            ("kv_bytes_per_token", "KV-cache bytes per token, all layers", s.get("kv_bytes_per_token", 0)),
            (
                "prefix_cache_hit_rate",
                "Prefix-cache hit tokens / queried tokens since start",
                s.get("prefix_cache_hit_rate", 0.0),
            ),
            ("engine_alive", "1 while the engine loop runs", 1.0 if self._alive() else 0.0),
        )
        for name, doc, value in mine:
            yield GaugeMetricFamily(f"mlaserve_{name}", doc, value=float(value))


class _CountsCollector(Collector):
    """The server-wide counts, read at scrape time: every API-server process reports the same figure."""

    def __init__(self, counts: ServerCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "mlaserve_http_requests_in_flight",
            "Sequences being served, all API-server processes (a request counts prompts x n)",
            value=self._counts.sequences.value,
        )
        yield GaugeMetricFamily(
            "mlaserve_http_connections_open",
            "Client connections open on the API port, all API-server processes",
            value=self._counts.connections.value,
        )


class ServerMetrics:
    def __init__(
        self,
        stats: Callable[[], dict],
        alive: Callable[[], bool],
        model_name: str = "mlaserve",
        max_model_len: int = 4096,
        counts: ServerCounts | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Several API-server processes (api_servers.py) keep their counters in shared files; any of them answers
        # a scrape with the sum. Engine figures come from the core's stats, the same in every process.
        self._exposition = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            self._exposition = CollectorRegistry(auto_describe=True)
            multiprocess.MultiProcessCollector(self._exposition)
        labels = {"model_name": model_name, "engine": "0"}
        self._labels = labels
        self.requests = Counter(
            "mlaserve_requests", "Generation requests by how they ended", ["status"], registry=self.registry
        )
        for status in STATUSES:  # present at 0, so dashboards and alerts see the series from the start
            self.requests.labels(status)
        # An idle connection closed to make room for a newer one is not an error anywhere else: this counter is
        # what shows a server evicting clients' kept-alive connections, and how often.
        self.connections_closed = Counter(
            "mlaserve_http_connections_closed",
            "API-port connections the server closed: evicted (idle, for a newer one at max_connections), refused "
            "(503 at the cap, none idle), header_timeout (no request line and headers in time)",
            ["reason"],
            registry=self.registry,
        )
        for reason in CLOSE_REASONS:
            self.connections_closed.labels(reason)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry).labels(
                **labels
            )

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in FINISH_REASONS
        }
        tokens = one_two_five_buckets(max_model_len)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        # vLLM's older name for the same inter-token gaps (it renamed, not redefined, the histogram); older
        # dashboards still read it. Not request_time_per_output_token, which is one average per request.
        self._itl_old_name = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LATENCY_BUCKETS,
        )
        self._tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _ITL_BUCKETS,
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _LATENCY_BUCKETS,
        )
        self._prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _LATENCY_BUCKETS,
        )
        self._decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _LATENCY_BUCKETS,
        )
        self._inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _LATENCY_BUCKETS,
        )
        self._prompt_len = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self._output_len = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self._max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self._n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self._exposition.register(_EngineCollector(stats, alive, labels))
        self._exposition.register(_CountsCollector(counts or ServerCounts.for_processes(1)))

    def count(self, status: str) -> None:
        self.requests.labels(status).inc()

    def connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason).inc()

    def inter_token_latency(self, gap: float) -> None:
        self._itl.observe(gap)
        self._itl_old_name.observe(gap)

    def request_started(self, n: int, max_tokens: int | None) -> None:
        self._n.observe(n)
        if max_tokens is not None:
            self._max_tokens.observe(max_tokens)

    def request_finished(
        self, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str | None, times: dict | None
    ) -> None:
        """One engine request (one choice) ended: vLLM's per-request histograms from the engine's time stamps."""
        reason = finish_reason if finish_reason in self._success else "abort"
        self._success[reason].inc()
        self._prompt_len.observe(num_prompt_tokens)
        self._output_len.observe(num_output_tokens)
        times = times or {}
        arrival, scheduled = times.get("arrival_time"), times.get("first_scheduled_time")
        first, done = times.get("first_token_time"), times.get("finished_time")
        if arrival is None or scheduled is None or done is None:
            return  # aborted before it was ever scheduled
        self._queue.observe(scheduled - arrival)
        self._inference.observe(done - scheduled)
        if first is not None:
            self._prefill.observe(first - scheduled)
            self._decode.observe(done - first)
            if num_output_tokens > 1:
                self._tpot.observe((done - first) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self._exposition)
