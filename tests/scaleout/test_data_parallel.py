"""`conveyor serve --data-parallel-size 2` as a user runs it: two replicas of a tiny model (one pinned
core each) behind vllm-router, on loopback. One deployment for the module, in this order: it serves and
reports each replica; cache-aware routing gets prefix-cache hits that round-robin does not; a replica
killed with SIGKILL under load costs only the streams that had started (each ends with an error event),
its queued requests are answered by the other replica, and the supervisor brings it back; SIGTERM
drains every replica and exits 0. Skipped without vllm-router or with fewer than 2 cores."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor.scaleout.net import free_port, http_ok
from conveyor.scaleout.routers import ROUTERS, RouterProcess

from tests.serving_helpers import metric, random_words, save_long_tiny

pytestmark = [pytest.mark.skipif(ROUTERS["vllm-router"].executable() is None, reason="vllm-router not installed"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")]

START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0


class Deployment:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc, self.url = proc, url

    def data(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/dashboard/data", timeout=10, trust_env=False).json()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    model = save_long_tiny(tmp_path_factory.mktemp("dp_tiny"))
    port = free_port()
    # max 2 requests per batch: a replica given more queues them (requests that have sent nothing yet);
    # a generous drain: under a loaded CI machine, 300 tokens on one thread took over 20 s
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve", "--model", str(model), "--dtype",
                             "float32", "--num-blocks", "512", "--max-requests-per-batch", "2", "--port", str(port),
                             "--data-parallel-size", "2", "--threads", "1", "--log-level", "warning",
                             "--shutdown-timeout", "90"], stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not http_ok(f"{url}/health"):
        assert proc.poll() is None, f"conveyor serve exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the deployment did not become healthy"
        time.sleep(0.2)
    yield Deployment(proc, url)
    if proc.poll() is None:  # a test failed before the drain test: its replicas die with it
        proc.kill()
        proc.wait()


def sample(text: str, prefix: str) -> float:
    """The value of the first Prometheus line starting with `prefix` (0 when there is none)."""
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def test_one_address_serves_and_reports_each_replica(deployment: Deployment):
    url = deployment.url
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0},
                       timeout=REQUEST_TIMEOUT_S, trust_env=False)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"] == "dp_tiny0"
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    for engine in ("0", "1", "all"):
        assert f'conveyor:prefix_cache_queries_total{{engine="{engine}",model_name="dp_tiny0"}}' in text
    assert metric(text, "conveyor:replica_up") == 1.0 and "vllm_router_" in text
    data = deployment.data()
    assert [e["state"] for e in data["engines"]] == ["up", "up"] and data["router"]["alive"]
    cpus = [e["placement"].split(":")[1] for e in data["engines"]]
    assert cpus[0] != cpus[1] and all("1 thread(s)" in c for c in cpus)  # a core each
    assert "Conveyor replicas" in httpx.get(f"{url}/dashboard", trust_env=False).text
    assert "requests" in httpx.get(f"{url}/engines/1/dashboard/data", trust_env=False).json()
    assert httpx.get(f"{url}/engines/7/metrics", trust_env=False).status_code == 404


def hits(url: str) -> float:
    """Prefix-cache hit tokens summed over the replicas (engine="all")."""
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return sample(text, 'conveyor:prefix_cache_hits_total{engine="all"')


def send_pairs(url: str, seed: int, groups: int = 4) -> None:
    """`groups` pairs of prompts, one at a time; a pair shares a 64-word prefix (4 pages)."""
    for g in range(groups):
        prefix = random_words(seed * 100 + g, 64)
        for q in range(2):
            body = {"prompt": f"{prefix} {random_words(seed * 1000 + g * 10 + q, 3)}", "max_tokens": 1}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S,
                              trust_env=False).status_code == 200


def test_cache_aware_routing_beats_round_robin_on_prefix_hits(deployment: Deployment):
    before = hits(deployment.url)
    send_pairs(deployment.url, seed=1)  # through the deployment's router: cache_aware
    cache_aware = hits(deployment.url) - before
    replicas = [e["url"] for e in deployment.data()["engines"]]
    rr = RouterProcess("vllm-router", replicas, policy="round_robin")
    rr.start()
    try:
        before = hits(deployment.url)
        send_pairs(rr.url, seed=2)  # new prefixes, the same replicas, round-robin: a pair is split
        round_robin = hits(deployment.url) - before
    finally:
        rr.stop()
    assert cache_aware >= 4 * 64 * 0.75  # most of each pair's second prefix comes from the cache
    assert cache_aware > 2 * round_robin


async def stream(client: httpx.AsyncClient, url: str, i: int, seen: asyncio.Event) -> dict[str, Any]:
    body = {"prompt": random_words(50 + i, 8), "max_tokens": 300, "ignore_eos": True, "stream": True}
    out: dict[str, Any] = {"status": None, "chunks": 0, "done": 0, "error": None}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        out["status"] = reply.status_code
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                out["done"] += 1
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                else:
                    out["chunks"] += 1
                    seen.set()
    return out


def test_kill_9_under_load_retries_queued_requests_and_the_replica_comes_back(deployment: Deployment):
    url = deployment.url
    victim = deployment.data()["engines"][1]

    async def load() -> list[dict[str, Any]]:
        seen = asyncio.Event()
        async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
            tasks = [asyncio.create_task(stream(client, url, i, seen)) for i in range(10)]
            await asyncio.wait_for(seen.wait(), REQUEST_TIMEOUT_S)
            deadline = time.monotonic() + 20
            while (await client.get(f"{url}/engines/1/dashboard/data")).json()["requests"]["waiting"] < 1:
                assert time.monotonic() < deadline, "replica 1 never had a queue"
                await asyncio.sleep(0.05)
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S)  # none hangs

    results = asyncio.run(load())
    failed = [r for r in results if r["error"] is not None]
    assert all(r["status"] == 200 and r["done"] == 1 for r in results)  # no 5xx, one answer each
    assert all(r["chunks"] <= 300 for r in results)  # none answered twice
    assert len(failed) <= 2  # only replica 1's running batch (2) had sent output; its queue was retried
    assert all(r["error"]["code"] == "replica_failed" and r["chunks"] > 0 for r in failed)
    assert sample(httpx.get(f"{url}/metrics", trust_env=False).text, "vllm_router_retries_total") > 0
    deadline = time.monotonic() + START_TIMEOUT_S
    while (engine := deployment.data()["engines"][1])["state"] != "up" or engine["restarts"] != 1:
        assert time.monotonic() < deadline, f"replica 1 not back: {engine}"
        time.sleep(0.2)
    assert engine["pid"] != victim["pid"] and engine["last_exit"] == "killed by SIGKILL"
    send_pairs(url, seed=3, groups=2)  # serving again


def test_sigterm_drains_every_replica_and_exits_0(deployment: Deployment):
    url, pids = deployment.url, [e["pid"] for e in deployment.data()["engines"]]

    async def load() -> tuple[list[dict[str, Any]], int]:
        seen = [asyncio.Event() for _ in range(4)]
        async with httpx.AsyncClient(trust_env=False, timeout=REQUEST_TIMEOUT_S) as client:
            tasks = [asyncio.create_task(stream(client, url, i, seen[i])) for i in range(4)]
            # every stream under way before the signal: one still in the router would rightly get a 503
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in seen)), REQUEST_TIMEOUT_S)
            deployment.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            late = await client.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 2})
            return await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S), late.status_code

    results, late = asyncio.run(load())
    assert late == 503
    assert all(r["status"] == 200 and r["done"] == 1 and r["error"] is None and r["chunks"] > 0 for r in results)
    assert deployment.proc.wait(60) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
