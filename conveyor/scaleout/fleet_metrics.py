"""`GET /metrics` of the replicas behind one address: every replica's series, and their sum.

Each replica's Prometheus text is re-labelled with `engine="<index>"` (vLLM's label for one engine of a
data-parallel deployment), and every series is also summed over the replicas that answered, labelled
`engine="all"`: counters, histogram buckets, sums and counts, and count-like gauges add up; a gauge that
is a fraction (`*_perc`) is averaged instead; `*_created` timestamps are not summed. So a fleet query
reads `x{engine="all"}`, and a query over replicas must leave it out (`sum(x{engine!="all"})`).
The supervisor's own gauges (`conveyor:replica_up`, `conveyor:replica_restarts`) are added, and the
router's own metrics (its names, e.g. `vllm_router_*`) are appended as the router writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

ALL = "all"


def averaged(family: Metric) -> bool:
    return family.type == "gauge" and family.name.endswith("_perc")


def merge(texts: Mapping[str, str]) -> list[Metric]:
    """The families of every replica's exposition `texts` (engine label -> text), each sample labelled
    with its engine, plus the `engine="all"` sums, in the order the families first appear."""
    families: dict[str, Metric] = {}
    sums: dict[tuple[str, str, tuple[tuple[str, str], ...]], list[float]] = {}
    for engine, text in texts.items():
        for fam in text_string_to_metric_families(text):
            out = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "engine": engine}, s.value)
                if not s.name.endswith("_created"):
                    sums.setdefault((fam.name, s.name, tuple(sorted(s.labels.items()))), []).append(s.value)
    for (fam_name, sample, labels), values in sums.items():
        family = families[fam_name]
        value = sum(values) / len(values) if averaged(family) else sum(values)
        family.add_sample(sample, {**dict(labels), "engine": ALL}, value)
    return list(families.values())


class FleetCollector(Collector):
    """Yields the merged families and the supervisor's per-replica gauges."""

    def __init__(self, families: Iterable[Metric], replicas: Iterable[Mapping[str, Any]]) -> None:
        self.families, self.replicas = list(families), list(replicas)

    def collect(self) -> Iterator[Metric]:
        yield from self.families
        up = GaugeMetricFamily("conveyor:replica_up", "1 while the replica answers /health.", labels=["engine", "url"])
        restarts = CounterMetricFamily("conveyor:replica_restarts", "Restarts of a local replica by the supervisor "
                                       "(after it exited or was killed).", labels=["engine", "url"])
        for r in self.replicas:
            up.add_metric([str(r["index"]), r["url"]], 1.0 if r["state"] == "up" else 0.0)
            restarts.add_metric([str(r["index"]), r["url"]], r["restarts"])
        yield up
        yield restarts


def render(texts: Mapping[str, str], replicas: Iterable[Mapping[str, Any]], router_text: str = "") -> bytes:
    """The front's `/metrics` body."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(merge(texts), replicas))
    return generate_latest(registry) + router_text.encode()
