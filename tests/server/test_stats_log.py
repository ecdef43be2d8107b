"""The periodic stats line (`--log-stats-interval`, `--disable-log-stats`): throughput over the interval,
the queues and the caches; nothing while the engine is idle."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import httpx
import pytest

from conveyor.engine.stats import EngineStats
from conveyor.server import BackgroundServer, ServerSettings
from conveyor.server.stats_log import StatsLog

from tests.serving_helpers import serve_parser
from tests.utils import TinyModel


def test_a_line_per_busy_interval_with_its_rates() -> None:
    now = EngineStats(total_blocks=100, free_blocks=100)
    log = StatsLog(lambda: now, interval=10)
    assert log.line() is None  # idle
    now = replace(now, prompt_tokens=3000, generation_tokens=500, running_requests=4, waiting_requests=2,
                  free_blocks=75, prefix_cache_query_tokens=3000, prefix_cache_hit_tokens=750)
    log.last_time -= 10  # ten seconds later
    line = log.line()
    assert line is not None
    rates = [float(part.split()[-2]) for part in line.split(", ")[:2]]
    assert rates == pytest.approx([300.0, 50.0], rel=0.01)
    assert "running 4 reqs, waiting 2 reqs" in line and "KV cache usage 25.0%" in line
    assert "prefix cache hit rate 25.0%" in line and "swapped" not in line
    now = replace(now, running_requests=0, waiting_requests=0)
    line = log.line()  # the interval the work ended in still gets its line
    assert line is not None and "prefix cache" not in line  # no lookups in it
    assert log.line() is None


def test_the_server_logs_stats_while_it_works(tiny_llama: TinyModel, caplog: pytest.LogCaptureFixture) -> None:
    assert ServerSettings.from_args(serve_parser().parse_args([])).log_stats_interval == 10
    assert ServerSettings.from_args(serve_parser().parse_args(["--disable-log-stats"])).log_stats_interval is None
    with pytest.raises(ValueError, match="--log-stats-interval"):
        ServerSettings.from_args(serve_parser().parse_args(["--log-stats-interval", "0"]))
    llm = tiny_llama.llm(num_blocks=64)
    try:
        with caplog.at_level(logging.INFO, logger="conveyor.server.stats"):
            with BackgroundServer(llm, ServerSettings(log_stats_interval=0.2)) as url:
                answer = httpx.post(f"{url}/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 40,
                                                                   "ignore_eos": True}, timeout=60)
                assert answer.status_code == 200
                time.sleep(0.5)
    finally:
        llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "conveyor.server.stats"]
    assert lines and all("generation throughput" in line for line in lines)
    assert any(float(line.split("generation throughput ")[1].split()[0]) > 0 for line in lines)
