"""The replica processes and the router: started, watched, restarted when they die, drained on stop.

A local replica is a plain `conveyor serve` child on a loopback port, pinned to its share of the cores
(`placement`); its log lines reach our stderr prefixed with `[replica i]`. A remote replica (another
machine's `conveyor serve`, `--data-parallel-address`) is only probed: its own supervisor (systemd, a
container runtime) restarts it. One watcher thread, once every `WATCH_S`:

- probes every replica's `GET /health` (the router does the same for routing; this is for the front's
  `/health`, `/metrics` and dashboard);
- restarts a local replica whose process has exited (kill -9, out of memory, engine death: `conveyor
  serve` exits 1 then) at once, on the same port, so the router's worker list stays valid and its
  health checks take it back once it answers; a replica that dies again within `STABLE_S` of its
  restart waits 1, 2, 4 ... up to `MAX_BACKOFF_S` seconds first, so a broken one cannot spin;
- restarts the router if it exits.

`stop()` drains: SIGTERM to every local replica at once (each stops taking requests and gives those in
flight `--shutdown-timeout` seconds), then waits for them, SIGKILL past the grace, then the router.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from .net import end_with_parent, http_ok
from .placement import Placement
from .routers import RouterProcess

logger = logging.getLogger("conveyor.scaleout")

WATCH_S = 0.5
STABLE_S = 30.0  # a replica that ran this long before dying is restarted at once
MAX_BACKOFF_S = 30.0
KILL_GRACE_S = 10.0  # after a replica's own drain time


@dataclass
class Replica:
    """One replica: its URL and, for a local one, its command, resources and process."""

    index: int
    url: str
    command: list[str] | None = None  # None: remote, not ours to start
    placement: Placement | None = None
    proc: subprocess.Popen[bytes] | None = None
    state: str = "starting"  # starting | up | down | stopped
    restarts: int = 0
    last_exit: str | None = None
    started_at: float = 0.0
    died_at: float | None = None
    last_recovery_s: float | None = None  # death to healthy again, the last time it died
    backoff_s: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each within STABLE_S of its start

    @property
    def local(self) -> bool:
        return self.command is not None

    def snapshot(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "local": self.local, "state": self.state,
                "pid": self.proc.pid if self.proc is not None else None, "restarts": self.restarts,
                "last_exit": self.last_exit, "last_recovery_s": self.last_recovery_s,
                "placement": self.placement.describe() if self.placement else None}


def exit_reason(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def pipe_lines(stream: IO[bytes], prefix: str) -> None:
    """Copy a child's output to our stderr, line by line, prefixed (a thread per child)."""
    for line in iter(stream.readline, b""):
        sys.stderr.write(f"{prefix} {line.decode(errors='replace')}")
    stream.close()


class Supervisor:
    """Local and remote replicas, and the router in front of them (started once they are healthy)."""

    def __init__(self, replicas: Sequence[Replica], router_factory: Callable[[list[str]], RouterProcess],
                 shutdown_timeout_s: float = 10.0, probe: Callable[[str], bool] | None = None) -> None:
        self.replicas = list(replicas)
        self.router_factory = router_factory
        self.router: RouterProcess | None = None
        self.router_restarts = 0
        self.shutdown_timeout_s = shutdown_timeout_s
        self.probe = probe or (lambda url: http_ok(f"{url}/health"))
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.watcher = threading.Thread(target=self.watch, name="conveyor-supervisor", daemon=True)

    # -- start -----------------------------------------------------------------------------
    def spawn(self, replica: Replica) -> None:
        assert replica.command is not None and replica.placement is not None
        cpus = set(replica.placement.cpus)
        replica.proc = subprocess.Popen(
            replica.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, **replica.placement.env()},
            preexec_fn=lambda: (os.sched_setaffinity(0, cpus), end_with_parent()))  # before torch's threads
        replica.state, replica.started_at = "starting", time.monotonic()
        threading.Thread(target=pipe_lines, args=(replica.proc.stdout, f"[replica {replica.index}]"),
                         daemon=True).start()
        logger.info("started %s (pid %d) at %s", replica.placement.describe(), replica.proc.pid, replica.url)

    def start(self, timeout_s: float = 600.0) -> None:
        """Start the local replicas, wait until every replica answers /health, then start the router.
        RuntimeError (everything stopped) when a replica exits or is not healthy within `timeout_s`."""
        started = time.monotonic()
        for replica in self.replicas:
            if replica.local:
                self.spawn(replica)
        try:
            pending = set(range(len(self.replicas)))
            while pending:
                for i in sorted(pending):
                    replica = self.replicas[i]
                    if replica.proc is not None and replica.proc.poll() is not None:
                        raise RuntimeError(f"replica {i} {exit_reason(replica.proc.returncode)} before it was "
                                           "ready; its log is above")
                    if self.probe(replica.url):
                        replica.state = "up"
                        pending.discard(i)
                if pending and time.monotonic() - started > timeout_s:
                    names = ", ".join(self.replicas[i].url for i in sorted(pending))
                    raise RuntimeError(f"replicas not healthy after {timeout_s:g} s: {names}")
                time.sleep(0.2)
            logger.info("%d replica(s) healthy in %.1f s", len(self.replicas), time.monotonic() - started)
            self.router = self.router_factory([r.url for r in self.replicas])
            took = self.router.start()
            logger.info("%s ready in %.2f s at %s", self.router.name, took, self.router.url)
        except BaseException:
            self.stop()
            raise
        self.watcher.start()

    # -- watch -----------------------------------------------------------------------------
    def watch(self) -> None:
        while not self.stopping.wait(WATCH_S):
            for replica in self.replicas:
                with self.lock:
                    if not self.stopping.is_set():
                        self.check(replica)
            router = self.router
            if router is not None and not router.alive() and not self.stopping.is_set():
                self.router_restarts += 1
                logger.error("%s exited; restarting it (restart %d)", router.name, self.router_restarts)
                try:
                    router.start()
                except RuntimeError as exc:
                    logger.error("%s", exc)

    def check(self, replica: Replica) -> None:
        now = time.monotonic()
        proc = replica.proc
        if proc is not None and proc.poll() is not None:  # died: restart after its backoff
            if replica.died_at is None:
                replica.died_at = now
                replica.last_exit = exit_reason(proc.returncode)
                replica.state = "down"
                replica.quick_deaths = replica.quick_deaths + 1 if now - replica.started_at < STABLE_S else 1
                replica.backoff_s = min(2.0 ** (replica.quick_deaths - 2), MAX_BACKOFF_S) \
                    if replica.quick_deaths > 1 else 0.0
                logger.error("replica %d (pid %d) %s; restarting it%s", replica.index, proc.pid, replica.last_exit,
                             f" in {replica.backoff_s:g} s" if replica.backoff_s else "")
            if now - replica.died_at >= replica.backoff_s:
                replica.restarts += 1
                self.spawn(replica)
            return
        healthy = self.probe(replica.url)
        if healthy and replica.state != "up":
            if replica.died_at is not None:
                replica.last_recovery_s = now - replica.died_at
                logger.info("replica %d is back %.1f s after it went down (restart %d)", replica.index,
                            replica.last_recovery_s, replica.restarts)
                replica.died_at = None
            replica.state = "up"
        elif not healthy and replica.state == "up":
            replica.state = "down"
            logger.warning("replica %d at %s does not answer /health", replica.index, replica.url)

    def snapshot(self) -> list[dict[str, Any]]:
        return [r.snapshot() for r in self.replicas]

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Drain every local replica (SIGTERM: each finishes what it has in flight within its
        --shutdown-timeout), wait for them, then stop the router. Idempotent."""
        self.stopping.set()
        with self.lock:
            procs = [r.proc for r in self.replicas if r.proc is not None and r.proc.poll() is None]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.shutdown_timeout_s + KILL_GRACE_S
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("replica pid %d did not stop in time: killed", proc.pid)
                    proc.kill()
                    proc.wait()
            for replica in self.replicas:
                replica.state = "stopped" if replica.local else replica.state
            if self.router is not None:
                self.router.stop()
