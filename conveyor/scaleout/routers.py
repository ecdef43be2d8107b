"""The production routers Conveyor's replicas sit behind, and the router process.

Both are Rust binaries shipped in PyPI wheels, forks of one code base (SGLang's router), with the same
cache-aware policy: a radix tree per replica of the request texts it was sent; a request goes to the
replica whose tree matches most of its text when the match is over `cache_threshold`, else to the one
with the smallest tree, unless the load is imbalanced (then to the least loaded). `vllm-router` is the
default (`pip install "conveyor[router]"`): it was measured against `sglang-router` here
(docs/design/replicas.md, "Router choice"), and it proxies `GET /v1/models` from a replica
(sglang-router 0.3 answers it itself, with the model named "unknown"). Each is found as its console script next to this Python, or
on PATH. Both expose their own Prometheus metrics on a second port, which Conveyor's front appends to
its `/metrics`.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import install_command
from .net import end_with_parent, free_port, http_ok

logger = logging.getLogger("conveyor.scaleout")

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")  # what both routers take
HEALTH_INTERVAL_S = 1  # the router's checks of every replica's /health
HEALTH_FAILURES = 2  # consecutive failed checks before a replica is marked down
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class RouterSpec:
    """How to start one router: its console script (and subcommand), the package that ships it, its
    log-level spelling, and the extra of pyproject.toml that installs it (None: none does)."""

    script: str
    subcommand: tuple[str, ...]
    package: str
    warning_level: str
    extra: str | None

    def executable(self) -> str | None:
        """The console script next to this interpreter (an unactivated venv), else on PATH."""
        beside = Path(sys.executable).parent / self.script
        return str(beside) if beside.exists() else shutil.which(self.script)

    def command(self, host: str, port: int, workers: Sequence[str], policy: str, metrics_port: int) -> list[str]:
        exe = self.executable()
        if exe is None:
            fix = (install_command(self.extra) if self.extra is not None
                   else f"pip install \"conveyor[router]\" (or pip install {self.package})")
            raise ValueError(f"the router {self.script!r} is not installed: {fix}")
        return [exe, *self.subcommand, "--host", host, "--port", str(port), "--worker-urls", *workers,
                "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
                "--health-failure-threshold", str(HEALTH_FAILURES), "--health-success-threshold", "1",
                "--log-level", self.warning_level]


ROUTERS: dict[str, RouterSpec] = {
    "vllm-router": RouterSpec("vllm-router", (), "vllm-router", "warning", "router"),
    "sglang-router": RouterSpec("sglang-router", ("launch",), "sglang-router", "warn", None),
}
DEFAULT_ROUTER = "vllm-router"


def check_router(name: str, policy: str) -> RouterSpec:
    """The router's spec, or ValueError naming what would work (unknown name or policy, not installed)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}: choose one of {', '.join(ROUTERS)}")
    if policy not in POLICIES:
        raise ValueError(f"unknown router policy {policy!r}: choose one of {', '.join(POLICIES)}")
    spec = ROUTERS[name]
    spec.command("127.0.0.1", 0, [], policy, 0)  # raises if it is not installed
    return spec


class RouterProcess:
    """The router, a child process on a loopback port, in front of `workers` (replica URLs)."""

    def __init__(self, name: str, workers: Sequence[str], policy: str = "cache_aware") -> None:
        self.spec = check_router(name, policy)
        self.name = name
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.command = self.spec.command("127.0.0.1", self.port, workers, policy, self.metrics_port)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> float:
        """Start it and wait until it reports ready (`GET /readiness`); returns the seconds that took."""
        started = time.monotonic()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                     preexec_fn=end_with_parent)
        while not http_ok(f"{self.url}/readiness"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} before it was ready; "
                                   "its log is above")
            if time.monotonic() - started > timeout_s:
                self.stop()
                raise RuntimeError(f"{self.name} was not ready after {timeout_s:g} s")
            time.sleep(0.1)
        return time.monotonic() - started

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %g s: killed", self.name, STOP_GRACE_S)
            self.proc.kill()
            self.proc.wait()
