"""The Ray Serve deployment on a local Ray instance (skipped without Ray): two replicas of a tiny model
behind the OpenAI-style ingress; with the prefix-aware request router, requests that share a prefix go
to the same replica and hit its prefix cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conveyor.scaleout.net import free_port

from tests.serving_helpers import random_words, save_long_tiny

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def app_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from conveyor.scaleout.ray_serve import conveyor_app

    model = save_long_tiny(tmp_path_factory.mktemp("ray_tiny"))
    # Ray Serve gives its HTTP proxy 3 x 5 s to start; a busy 2-core machine needs more
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(conveyor_app(str(model), num_replicas=2, threads=1, dtype="float32", config={"num_blocks": 256}),
                  route_prefix="/", name="conveyor")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
                       timeout=60, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_replicas_behind_the_prefix_aware_router_share_prefixes(app_url: str):
    first = complete(app_url, "w5 w6 w7", max_tokens=3)
    assert first["usage"]["completion_tokens"] == 3 and first["choices"][0]["finish_reason"] == "length"
    same_replica, hits = 0, 0
    for g in range(4):
        prefix = random_words(100 + g, 64)  # 4 pages of 16
        a = complete(app_url, f"{prefix} {random_words(200 + g, 3)}")["conveyor"]
        b = complete(app_url, f"{prefix} {random_words(300 + g, 3)}")["conveyor"]
        if a["replica"] == b["replica"]:
            same_replica += 1
            hits += b["prefix_cache_hit_tokens"] - a["prefix_cache_hit_tokens"]
    assert same_replica == 4  # Ray's default (power of two choices) would split about half the pairs
    assert hits >= same_replica * 64 * 0.75  # the shared pages came from the cache
