"""`bench serve --kill-replica I --kill-after S`: a replica killed with SIGKILL in the middle of the run.

For `conveyor serve --data-parallel-size N` on this machine: S seconds into the run the benchmark
reads replica I's pid from the front's `/dashboard/data` and kills it, then, after the run, waits for
the supervisor to bring it back (a new pid, answering /health) and reports the supervisor's count from
the death to the first healthy answer. The report sorts every request by its
end: answered; cut after it had streamed output (the error event `replica_failed`: it cannot be retried
without answering twice); a 5xx status; no answer within `--request-timeout` (hung); anything else. The
targets: no 5xx for requests that had not started streaming, none hung.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .serve_client import RequestResult

RECOVERY_TIMEOUT_S = 600.0


def dashboard_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return (base[:-3] if base.endswith("/v1") else base) + "/dashboard/data"


async def replica(url: str, engine: int) -> dict[str, Any]:
    """Replica `engine` as the front's dashboard data shows it (its own connection: the benchmark's pool may
    be full of streams)."""
    import httpx

    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        engines = (await client.get(url)).json().get("engines")
    if not engines or not 0 <= engine < len(engines) or not engines[engine]["local"]:
        raise RuntimeError(f"--kill-replica {engine}: the server at {url} has no local replica {engine} (it must "
                           "be `conveyor serve --data-parallel-size N` on this machine)")
    return engines[engine]


async def kill_later(base_url: str, engine: int, after_s: float, t0: float) -> dict[str, Any]:
    """Kill replica `engine` `after_s` seconds after `t0` (perf_counter); what was killed, and when."""
    url = dashboard_url(base_url)
    await asyncio.sleep(max(0.0, t0 + after_s - time.perf_counter()))
    target = await replica(url, engine)
    os.kill(target["pid"], signal.SIGKILL)
    return {"engine": engine, "pid": target["pid"], "killed_at_s": time.perf_counter() - t0,
            "killed_monotonic": time.monotonic()}


async def wait_recovery(base_url: str, fault: dict[str, Any]) -> dict[str, Any]:
    """Poll until the killed replica is back (a new pid, state up); the fault with the recovery times."""
    url = dashboard_url(base_url)
    while time.monotonic() - fault["killed_monotonic"] < RECOVERY_TIMEOUT_S:
        now = await replica(url, fault["engine"])
        if now["pid"] != fault["pid"] and now["state"] == "up":
            return fault | {"supervisor_recovery_s": now["last_recovery_s"], "restarts": now["restarts"]}
        await asyncio.sleep(0.2)
    return fault | {"supervisor_recovery_s": None}


def classify(results: Sequence[RequestResult]) -> dict[str, int]:
    """How each request ended (see the module's docstring)."""
    def kind(r: RequestResult) -> str:
        if r.success:
            return "answered"
        if r.status is not None and r.status >= 500:
            return "5xx"
        if r.error and "replica_failed" in r.error and r.token_chunks > 0:
            return "cut after output"
        if r.error and r.error.startswith("timed out"):
            return "hung (timed out)"
        return "other failure"

    return dict(Counter(kind(r) for r in results))


def format_fault(fault: dict[str, Any]) -> list[str]:
    back = fault.get("supervisor_recovery_s")
    rows = [f"replica {fault['engine']} (pid {fault['pid']}) killed at {fault['killed_at_s']:.1f} s",
            "back serving after " + ("n/a (not back)" if back is None else
                                     f"{back:.1f} s (from its death to its first healthy /health)")]
    rows += [f"{count:>5} {kind}" for kind, count in sorted(fault["requests"].items())]
    return rows


def add_fault_arguments(parser: Any) -> None:
    group = parser.add_argument_group("fault injection (conveyor serve --data-parallel-size N on this machine)")
    group.add_argument("--kill-replica", type=int, default=None, metavar="I",
                       help="kill replica I with SIGKILL during each run, and report how requests ended and when it "
                       "was back")
    group.add_argument("--kill-after", type=float, default=5.0, metavar="S",
                       help="seconds into the run (default 5)")
