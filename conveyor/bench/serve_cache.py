"""Prefix-cache hits and requests per replica during one `bench serve` run, from the server's /metrics.

Read before and after the run (the difference is the run's own), from Conveyor's counters
`conveyor:prefix_cache_queries_total`, `conveyor:prefix_cache_hits_total` (tokens) and
`conveyor:request_success_total` (requests, any finish reason). Behind `conveyor serve
--data-parallel-size N` the series carry `engine="0"`, `"1"`, ... and the sum `engine="all"`; a single
server's have no engine label and count as engine "0". So the same run against a router with
`--router-policy cache_aware` and `round_robin` shows what cache-aware routing is worth. A server without
these metrics (another engine) gives no table.
"""

from __future__ import annotations

from typing import Any

COUNTERS = {"conveyor:prefix_cache_queries": "queries", "conveyor:prefix_cache_hits": "hits",
            "conveyor:request_success": "requests"}


def metrics_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/metrics"


def parse_counters(text: str) -> dict[str, dict[str, float]]:
    """engine -> {"queries", "hits", "requests"} from an exposition text (engine "all" left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        key = COUNTERS.get(family.name)
        if key is None:
            continue
        for s in family.samples:
            engine = s.labels.get("engine", "0")
            if s.name.endswith("_total") and engine != "all":
                counts = out.setdefault(engine, {"queries": 0.0, "hits": 0.0, "requests": 0.0})
                counts[key] += s.value
    return out


async def scrape(client: Any, url: str) -> dict[str, dict[str, float]] | None:
    """The counters now, or None when the server has none (or no /metrics)."""
    import httpx

    try:
        reply = await client.get(url, timeout=10.0)
    except httpx.HTTPError:
        return None
    return (parse_counters(reply.text) or None) if reply.status_code == 200 else None


def run_delta(before: dict[str, dict[str, float]] | None,
              after: dict[str, dict[str, float]] | None) -> dict[str, Any] | None:
    """Per engine and in all: requests served, prefix-cache query and hit tokens, hit rate, in the run."""
    if before is None or after is None:
        return None

    def entry(queries: float, hits: float, requests: float) -> dict[str, Any]:
        return {"requests": int(requests), "query_tokens": int(queries), "hit_tokens": int(hits),
                "hit_rate": hits / queries if queries else None}

    engines = {}
    for engine, now in sorted(after.items(), key=lambda kv: (len(kv[0]), kv[0])):
        was = before.get(engine, {"queries": 0.0, "hits": 0.0, "requests": 0.0})  # restarted replicas: from 0
        d = {k: now[k] - was[k] if now[k] >= was[k] else now[k] for k in now}
        engines[engine] = entry(d["queries"], d["hits"], d["requests"])
    total = entry(sum(e["query_tokens"] for e in engines.values()), sum(e["hit_tokens"] for e in engines.values()),
                  sum(e["requests"] for e in engines.values()))
    return {"engines": engines, "total": total}


def format_cache(cache: dict[str, Any]) -> list[str]:
    """Rows for the run's table: one per engine, then the total."""
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    rows = [f"{'engine':<8} {'requests':>9} {'prompt tok':>11} {'hit tok':>9} {'hit rate':>9}"]
    for name, e in [*cache["engines"].items(), ("all", cache["total"])]:
        rows.append(f"{name:<8} {e['requests']:>9} {e['query_tokens']:>11} {e['hit_tokens']:>9} "
                    f"{pct(e['hit_rate']):>9}")
    return rows
