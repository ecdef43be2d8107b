"""`conveyor serve --data-parallel-size N`: N replicas behind a router at one address.

Everything is checked before anything starts (the cores or GPUs each local replica gets, the router and
its policy, the remote addresses); then the local replicas start (each a plain `conveyor serve` on a
loopback port, with the same engine options), the router starts once every replica answers `/health`,
and the front serves the public address until SIGINT/SIGTERM, when it drains everything.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from ..cli_args import add_serve_args
from ..server import GracefulServer
from ..server.log_format import endpoint_list, uvicorn_logging
from ..server.tls import TLSSettings, scheme, uvicorn_tls
from .front import Front, build_front
from .net import free_port, replica_url
from .placement import Placement, plan_placement
from .routers import RouterProcess, check_router
from .supervisor import Replica, Supervisor

logger = logging.getLogger("conveyor.scaleout")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health probe otherwise

# Every replica gets its own loopback address, spoken to in plain HTTP (the front terminates TLS).
NOT_FORWARDED = {"host", "port", "help", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs"}


def forwarded_options(args: argparse.Namespace) -> list[str]:
    """`conveyor serve`'s engine and server options as given (those not at their defaults), as a command
    line for each replica."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_args(parser)
    argv: list[str] = []
    for action in parser._actions:
        if action.dest in NOT_FORWARDED or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:  # store_true
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def visible_gpus(device: str) -> int:
    """GPUs the replicas are spread over: none on CPU."""
    import torch

    return torch.cuda.device_count() if device in ("cuda", "auto") and torch.cuda.is_available() else 0


def plan(args: argparse.Namespace) -> tuple[list[Placement], list[str]]:
    """The local placements and the remote URLs; ValueError for settings that cannot run."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    remote = [replica_url(a) for a in args.data_parallel_address or []]
    local = args.data_parallel_size - len(remote)
    if local < 0:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} counts every replica, the "
                         f"{len(remote)} --data-parallel-address ones included: give at least {len(remote)}")
    check_router(args.router, args.router_policy)
    ranks = getattr(args, "tensor_parallel_size", None) or 1
    return plan_placement(local, args.threads, gpus=visible_gpus(args.device), ranks=ranks), remote


def build_supervisor(args: argparse.Namespace, placements: list[Placement], remote: list[str]) -> Supervisor:
    options = forwarded_options(args)
    replicas = []
    for p in placements:
        port = free_port()
        command = [sys.executable, "-m", "conveyor.cli", "serve", *options, "--host", "127.0.0.1",
                   "--port", str(port), "--data-parallel-size", "1"]
        replicas.append(Replica(p.index, f"http://127.0.0.1:{port}", command, p))
    replicas += [Replica(len(placements) + i, url) for i, url in enumerate(remote)]

    def router(workers: list[str]) -> RouterProcess:
        return RouterProcess(args.router, workers, args.router_policy)

    return Supervisor(replicas, router, shutdown_timeout_s=args.shutdown_timeout)


def front_config(app: Any, args: argparse.Namespace, tls: TLSSettings | None) -> uvicorn.Config:
    """The front's server, with a single server's address, TLS and log options (JSON lines, the access log
    and the paths it leaves out)."""
    logs = uvicorn_logging(args.log_format, not args.disable_uvicorn_access_log,
                           endpoint_list(args.disable_access_log_for_endpoints))
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                          timeout_graceful_shutdown=5, **logs, **uvicorn_tls(tls), root_path=args.root_path)


def serve_data_parallel(args: argparse.Namespace) -> int:
    """Run the replicas, the router and the front until SIGINT/SIGTERM; 0 after a clean drain."""
    tls = TLSSettings.from_args(args)
    placements, remote = plan(args)
    supervisor = build_supervisor(args, placements, remote)
    for p in placements:
        logger.info("%s", p.describe())
    try:
        supervisor.start(timeout_s=args.data_parallel_start_timeout)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    front = Front(supervisor)
    config = front_config(build_front(front), args, tls)

    def drain(then: Callable[[], None]) -> bool:
        front.stopping = True
        logger.info("shutting down: draining %d replica(s) (up to %g s)", len(supervisor.replicas),
                    args.shutdown_timeout)
        threading.Thread(target=lambda: (supervisor.stop(), then()), name="conveyor-drain", daemon=True).start()
        return True

    logger.info("serving %d replica(s) behind %s at %s://%s:%d", len(supervisor.replicas),
                args.router, scheme(tls), args.host, args.port)
    try:
        GracefulServer(config, drain).run()
    finally:
        supervisor.stop()
    return 0
