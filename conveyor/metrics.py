"""Prometheus metrics under vLLM's names with a `conveyor:` prefix, in a registry of their own: the
server's `/metrics` (`server.serving`, one per app) and `LLM.get_metrics` (the offline calls'), and
vLLM's reader types for the latter (`Counter`, `Gauge`, `Histogram`, `Vector`: `snapshot`).

Latency histograms are observed once per finished request from `RequestOutput.metrics` (on the
engine thread or the caller's; prometheus-client is thread-safe). Engine counters and gauges are read
from `llm.stats()` at read time by a custom collector, so they also count requests that did not come
through the registry's owner (e.g. `LLM.generate` on a served engine); so is the KV pool's resident size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .engine.stats import EngineStats
from .request import RequestOutput

# vLLM's buckets.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


class EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 kv_resident_bytes: Callable[[], int] | None = None) -> None:
        self.stats, self.model_name, self.kv_resident_bytes = stats, model_name, kv_resident_bytes

    def collect(self) -> Iterator[prometheus_client.Metric]:
        s = self.stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"conveyor:{name}", doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"conveyor:{name}", doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        yield gauge("num_requests_running", "Requests in the engine's running batch (prefilling or decoding).",
                    s.running_requests)
        yield gauge("num_requests_waiting", "Requests waiting in the engine's queue.", s.waiting_requests)
        yield gauge("kv_cache_usage_perc", "KV cache usage: 1 = every block in use.", s.kv_cache_usage)
        if self.kv_resident_bytes is not None:
            yield gauge("kv_cache_resident_bytes", "Bytes of the KV pool in physical memory (on CPU it is committed "
                        "as chunks are first written, so this grows towards the pool's size).",
                        self.kv_resident_bytes())
        yield counter("prefix_cache_queries", "Prefix cache queries, in tokens.", s.prefix_cache_query_tokens)
        yield counter("prefix_cache_hits", "Prefix cache hits, in tokens.", s.prefix_cache_hit_tokens)
        yield counter("num_preemptions", "Preemptions of running requests (offload or soft reset).", s.offloads)
        yield counter("prompt_tokens", "Prompt tokens of every admitted request.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("cuda_graph_captures", "Decode shapes captured as CUDA graphs.", s.cuda_graph_captures)
        yield counter("cuda_graph_replays", "Steps run by replaying a CUDA graph.", s.cuda_graph_replays)
        yield counter("cuda_graph_eager_steps", "Steps run eagerly while CUDA graphs are on (prefill chunks, "
                      "shapes over the largest bucket).", s.cuda_graph_eager_steps)
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding is on
            yield counter("spec_decode_num_drafts", "Verification passes with proposals.", s.spec_decode_num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Tokens proposed.", s.spec_decode_num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                          s.spec_decode_num_accepted_tokens)
            per_pos = CounterMetricFamily("conveyor:spec_decode_num_accepted_tokens_per_pos",
                                          "Proposed tokens accepted, by position in the proposal.",
                                          labels=labels + ["position"])
            for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([self.model_name, str(pos)], value)
            yield per_pos


class Metrics:
    """The latency histograms, finished and rejected counters, and the engine's counters and gauges."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 kv_resident_bytes: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: list[float]) -> prometheus_client.Histogram:
            return prometheus_client.Histogram(f"conveyor:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              TTFT_BUCKETS).labels(model_name)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ITL_BUCKETS).labels(model_name)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per request.", ITL_BUCKETS).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS).labels(model_name)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                               REQUEST_BUCKETS).labels(model_name)
        self.success = prometheus_client.Counter(
            "conveyor:request_success", "Finished requests by finish_reason (stop, length, abort, error, timeout).",
            ["model_name", "finish_reason"], registry=self.registry)
        self.rejected = prometheus_client.Counter(
            "conveyor:request_rejected", "Requests answered 503 (queue full or shutting down).", labels,
            registry=self.registry).labels(model_name)
        self.registry.register(EngineStatsCollector(stats, model_name, kv_resident_bytes))

    def observe_finished(self, out: RequestOutput) -> None:
        self.success.labels(self.model_name, out.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        times = m.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# vLLM's reader types (`vllm.v1.metrics.reader`): what `LLM.get_metrics` returns.
@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """Counters by position (vLLM's for `spec_decode_num_accepted_tokens_per_pos`)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound -> cumulative count, "+Inf" included


def snapshot(registry: CollectorRegistry) -> list[Metric]:
    """The registry's metrics as vLLM's `LLM.get_metrics` gives them: one per label set."""
    out: list[Metric] = []
    for family in registry.collect():
        samples = family.samples
        if family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in samples]
        elif family.type == "counter" and family.name.endswith("_per_pos"):
            totals = [s for s in samples if s.name.endswith("_total")]
            labels = {k: v for k, v in totals[0].labels.items() if k != "position"} if totals else {}
            values = [int(s.value) for s in sorted(totals, key=lambda s: int(s.labels["position"]))]
            out.append(Vector(family.name, labels, values))
        elif family.type == "counter":
            out += [Counter(family.name, dict(s.labels), int(s.value)) for s in samples if s.name.endswith("_total")]
        elif family.type == "histogram":
            groups: dict[tuple[tuple[str, str], ...], Histogram] = {}
            for s in samples:
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                h = groups.setdefault(key, Histogram(family.name, dict(key), 0, 0.0, {}))
                if s.name.endswith("_bucket"):
                    h.buckets[s.labels["le"]] = int(s.value)
                elif s.name.endswith("_count"):
                    h.count = int(s.value)
                elif s.name.endswith("_sum"):
                    h.sum = s.value
            out += groups.values()
    return out
