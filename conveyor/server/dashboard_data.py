"""What `GET /dashboard/data` answers: the engine's gauges and counters, its recent steps, the KV
pool per attention type, its size and resident bytes, and TTFT / inter-token latency percentiles of
recently finished requests.

Everything is read at request time (the page polls twice a second) from `EngineStats`, the
engine's `StepHistory` ring and a bounded window of latency samples that the server's metrics fill
as requests finish; nothing here runs per step (the pool's resident bytes cost one `mincore` over
its pages, a few milliseconds for 10 GB).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from ..llm import LLM

STEP_HISTORY = 600  # steps the server keeps when the engine was built without a history
RATE_WINDOW_S = 5.0  # output tok/s and mean step time over the steps that ended this recently
PERCENTILES = (50, 90, 99)


class LatencyWindow:
    """The last TTFT and inter-token gaps (seconds) of finished requests, for percentiles."""

    def __init__(self, max_ttft: int = 1024, max_itl: int = 8192) -> None:
        self.ttft: deque[float] = deque(maxlen=max_ttft)
        self.itl: deque[float] = deque(maxlen=max_itl)
        self._lock = threading.Lock()

    def observe(self, ttft: float | None, token_times: list[float]) -> None:
        with self._lock:
            if ttft is not None:
                self.ttft.append(ttft)
            self.itl.extend(b - a for a, b in zip(token_times, token_times[1:]))

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        with self._lock:
            ttft, itl = list(self.ttft), list(self.itl)
        return {"ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl)}


def percentiles(samples: Iterable[float]) -> dict[str, float | int | None]:
    """Nearest-rank p50/p90/p99 in milliseconds, and the sample count."""
    values = sorted(samples)
    out: dict[str, float | int | None] = {"count": len(values)}
    for p in PERCENTILES:
        out[f"p{p}"] = values[min(len(values) - 1, (len(values) * p - 1) // 100)] * 1e3 if values else None
    return out


def dashboard_data(llm: LLM, latencies: LatencyWindow, in_flight: int) -> dict[str, Any]:
    s = llm.stats()
    total, records = llm.enable_step_history(STEP_HISTORY).snapshot()
    now = time.monotonic()
    recent = [r for r in records if r.time > now - RATE_WINDOW_S]
    kv = llm.cache_usage()
    cached = kv["cached"]
    first = total - len(records)
    return {
        "requests": {"running": s.running_requests, "waiting": s.waiting_requests, "swapped": s.swapped_requests,
                     "in_flight": in_flight, "finished": s.finished_requests},
        "kv": {"total": s.total_blocks, "free": s.free_blocks - cached, "cached": cached,
               "used": s.total_blocks - s.free_blocks, "usage": s.kv_cache_usage, "groups": kv["groups"],
               "swap_free": s.swap_free_blocks, "swap_total": s.swap_total_blocks,
               "bytes": kv["bytes"], "resident_bytes": kv["resident_bytes"]},
        "prefix_cache": {"query_tokens": s.prefix_cache_query_tokens, "hit_tokens": s.prefix_cache_hit_tokens,
                         "hit_rate": s.prefix_cache_hit_tokens / s.prefix_cache_query_tokens
                         if s.prefix_cache_query_tokens else None},
        "tokens": {"prompt": s.prompt_tokens, "generation": s.generation_tokens, "prefill": s.prefill_tokens},
        "recent": {"window_s": RATE_WINDOW_S, "steps": len(recent),
                   "output_tok_s": sum(r.sampled_tokens for r in recent) / RATE_WINDOW_S,
                   "step_ms": sum(r.duration for r in recent) / len(recent) * 1e3 if recent else None},
        "steps": {"index": list(range(first, total)),
                  "duration_ms": [r.duration * 1e3 for r in records],
                  "decode_rows": [r.decode_rows for r in records],
                  "prefill_tokens": [r.prefill_tokens for r in records],
                  "padding_tokens": [r.padding_tokens for r in records],
                  "sampled_tokens": [r.sampled_tokens for r in records]},
        "latency": latencies.summary(),
    }
