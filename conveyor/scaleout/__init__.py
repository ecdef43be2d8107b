"""Past one process: replicas of the engine behind one address, and a Ray Serve deployment.

`conveyor serve --data-parallel-size N` (vLLM's flag) runs N engine processes, each with its own KV
cache, prefix cache and share of the cores (or its own GPU), behind an existing production router with
cache-aware routing (`vllm-router` by default, `sglang-router` too: the optional extra
`conveyor[router]`). Replicas on other machines join with `--data-parallel-address`. Modules:

- `placement`: the cores (pinned, never shared) or GPU of each local replica;
- `net`: free ports, replica addresses checked before start, a health probe;
- `routers`: the routers Conveyor knows (`ROUTERS`) and the router process;
- `supervisor`: replica processes and the router, watched and restarted, drained on stop;
- `fleet_metrics`: every replica's Prometheus metrics, labelled by engine, and their sums;
- `front`: the public address (generation through the router; health, metrics, dashboard here);
- `launch`: `conveyor serve --data-parallel-size` put together;
- `ray_serve`: the same engine as a Ray Serve deployment (the optional extra `conveyor[ray]`).

What happens when a replica dies under load: requests it had not answered at all are retried by the
router on another replica (Conveyor's server sends a stream's headers only with its first output, so a
queued request has sent nothing); a stream that had started ends with an error event naming the failure
(no request is answered twice); the router's health checks mark the replica down within about
`HEALTH_INTERVAL_S` x `HEALTH_FAILURES` seconds, the supervisor restarts it on the same port, and the
router takes it back at its first healthy check.
"""

from __future__ import annotations

import argparse
from types import ModuleType

from ..errors import require
from .routers import DEFAULT_ROUTER, POLICIES, ROUTERS

__all__ = ["add_data_parallel_args", "launch_module", "serve_data_parallel"]


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    """`conveyor serve`'s options for replicas behind a router."""
    group = parser.add_argument_group("data parallel (replicas behind a router; pip install \"conveyor[router]\")")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                       help="replicas of the engine, each its own process with its own KV cache, behind one "
                       "router at --host:--port (default 1: no router); counts the --data-parallel-address ones")
    group.add_argument("--data-parallel-address", nargs="+", default=None, metavar="URL",
                       help="replicas already serving on other machines (`conveyor serve --host 0.0.0.0` there), "
                       "e.g. http://10.0.0.2:8000; the router fronts them with the local ones")
    group.add_argument("--threads", type=int, default=None,
                       help="torch threads per engine process, each pinned to cores of its own (default: the "
                       "cores this process may use, divided among the local replicas)")
    group.add_argument("--router", default=DEFAULT_ROUTER, metavar="NAME",
                       help=f"the router: {', '.join(ROUTERS)} (default {DEFAULT_ROUTER})")
    group.add_argument("--router-policy", default="cache_aware", metavar="POLICY",
                       help=f"how the router picks a replica: {', '.join(POLICIES)} (default cache_aware: "
                       "requests that share a prefix go to the replica that has it cached)")
    group.add_argument("--data-parallel-start-timeout", type=float, default=600.0, metavar="S",
                       help="seconds every replica gets to answer /health at start")


def launch_module() -> ModuleType:
    """`scaleout.launch`, imported here once httpx is known to be installed (the front and the health
    checks need it; the `router` extra brings it): without it, one line saying how to install it."""
    require("httpx", "router", "conveyor serve --data-parallel-size")
    from . import launch

    return launch


def serve_data_parallel(args: argparse.Namespace) -> int:
    """Run `conveyor serve --data-parallel-size N`."""
    return launch_module().serve_data_parallel(args)
