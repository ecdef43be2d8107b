"""The periodic stats line (vLLM's): every `--log-stats-interval` seconds (default 10, vLLM's
VLLM_LOG_STATS_INTERVAL) while the engine has work or did some since the last line, the prompt and
generation throughput over that interval, the requests running, waiting and swapped out, the KV cache's
use and the prefix cache's hit rate over the interval's lookups. Off with `--disable-log-stats`.

It reads the same `EngineStats` snapshot as /metrics, on the event loop, and keeps the previous one to
take differences: O(1) a line, nothing on the engine's thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..engine.stats import EngineStats

logger = logging.getLogger("conveyor.server.stats")


class StatsLog:
    def __init__(self, stats: Callable[[], EngineStats], interval: float) -> None:
        self.stats, self.interval = stats, interval
        self.last = stats()
        self.last_time = time.monotonic()

    def line(self) -> str | None:
        """The line for the interval since the previous call; None when the engine was idle throughout."""
        now, now_time = self.stats(), time.monotonic()
        last, elapsed = self.last, max(now_time - self.last_time, 1e-9)
        self.last, self.last_time = now, now_time
        prompt = now.prompt_tokens - last.prompt_tokens
        generated = now.generation_tokens - last.generation_tokens
        busy = now.running_requests or now.waiting_requests or last.running_requests or last.waiting_requests
        if not (prompt or generated or busy):
            return None
        text = (f"prompt throughput {prompt / elapsed:.1f} tok/s, generation throughput {generated / elapsed:.1f} "
                f"tok/s, running {now.running_requests} reqs, waiting {now.waiting_requests} reqs")
        if now.swap_total_blocks:
            text += f" ({now.swapped_requests} swapped out)"
        text += f", KV cache usage {100 * now.kv_cache_usage:.1f}%"
        queried = now.prefix_cache_query_tokens - last.prefix_cache_query_tokens
        if queried:
            hits = now.prefix_cache_hit_tokens - last.prefix_cache_hit_tokens
            text += f", prefix cache hit rate {100 * hits / queried:.1f}%"
        return text

    async def run(self) -> None:
        """Log a line every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            if (text := self.line()) is not None:
                logger.info("%s", text)
