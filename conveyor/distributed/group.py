"""The tensor-parallel process group: torch.distributed's groups, their timeouts, and what a failure
becomes (`DistributedError`, which the engine lets through to its death path).

Three groups over the same ranks, as vLLM keeps a CPU group beside the device group:

- the default group (`init_process_group`, gloo): loading a model (a gather of every rank's result),
  with `LOAD_TIMEOUT_S`, since ranks load their shards at their own pace;
- `control` (gloo): rank 0's commands to the others (`worker.py`), pickled. Between requests the
  other ranks wait here for as long as rank 0 stays idle, so its timeout is a week: a dead rank 0
  is noticed by its closed connection (and, for spawned ranks, a parent watchdog), not by time;
- `compute` (gloo on CPU, NCCL on CUDA): the collectives inside a step (all-reduces, the logits
  gather, the hidden rows the LM head needs), with the step timeout `CONVEYOR_TP_TIMEOUT`
  (seconds, default 120): ranks reach them together, so a rank that does not within that time is
  stuck, and the step fails instead of hanging.

A rank that dies closes its connections, so the collective in progress fails at once (gloo:
"Connection closed by peer"); spawned ranks are also watched by their process sentinels
(`watch`), so the next command reports which rank died and how, even if rank 0 was idle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError

logger = logging.getLogger("conveyor")

LOAD_TIMEOUT_S = 1800.0
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_STEP_TIMEOUT_S = 120.0


def step_timeout() -> float:
    """Seconds a rank may be late to a step's collective before the step fails (`CONVEYOR_TP_TIMEOUT`)."""
    value = os.environ.get("CONVEYOR_TP_TIMEOUT", "")
    try:
        seconds = float(value) if value else DEFAULT_STEP_TIMEOUT_S
    except ValueError:
        raise ValueError(f"CONVEYOR_TP_TIMEOUT must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"CONVEYOR_TP_TIMEOUT must be > 0 seconds, got {value!r}")
    return seconds


def describe_exit(rank: int, pid: int | None, code: int | None) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
    return f"tensor-parallel rank {rank} (pid {pid}) {how}"


class RankGroup:
    """This process's place in the group (`rank` of `world_size`) and the collectives over it; the
    `layers.parallel.Collectives` the sharded model calls."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        timeout = timedelta(seconds=step_timeout())
        # Timeouts are each process's own: rank 0's sends give up after a step's timeout, the others wait idle.
        idle = timeout if rank == 0 else timedelta(seconds=IDLE_TIMEOUT_S)
        self.control = dist.new_group(backend="gloo", timeout=idle)
        self.compute = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
        self.failure: str | None = None  # what killed the group, once something did
        self.listeners: list[Callable[[str], None]] = []  # told the failure once (rank 0: the engines' managers)
        self.lock = threading.Lock()  # rank 0: one command and the collectives of its call at a time
        self.closed = False
        self.watched: dict[int, Any] = {}  # rank 0 on one machine: rank -> the process it spawned

    @classmethod
    def join(cls, rank: int, world_size: int, device: torch.device, store: dist.Store | None = None) -> RankGroup:
        """Join the group: through `store` (spawned ranks), else from torchrun's environment
        (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=LOAD_TIMEOUT_S),
                                **kwargs)
        return cls(rank, world_size, device)

    # -- the collectives of a step (layers.parallel.Collectives) ---------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        with self.failures("all-reduce"):
            dist.all_reduce(x, group=self.compute)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        with self.failures("logits gather"):
            dist.gather(x, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype)."""
        with self.failures("broadcast"):
            dist.broadcast(x, src=0, group=self.compute)
        return x

    # -- commands (rank 0 to the others) and load results ----------------------------------
    def send(self, command: object) -> None:
        """Rank 0: one command to every other rank."""
        with self.failures("command"):
            dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> object:
        """Another rank: the next command from rank 0 (waits as long as rank 0 is idle)."""
        box: list[object] = [None]
        with self.failures("command"):
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_objects(self, obj: object) -> list[object] | None:
        """Every rank's `obj` on rank 0 (None elsewhere), with the load timeout."""
        out: list[object] | None = [None] * self.world_size if self.rank == 0 else None
        with self.failures("load"):
            dist.gather_object(obj, out, dst=0)
        return out

    # -- failures ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise `DistributedError` if the group has failed (a rank died, a collective timed out)."""
        if self.failure is not None:
            raise DistributedError(self.failure)

    def fail(self, reason: str) -> None:
        """Mark the group failed (the first reason stays) and tell the listeners."""
        if self.failure is not None or self.closed:
            return
        self.failure = reason
        logger.error("tensor-parallel group failed: %s", reason)
        for listener in list(self.listeners):
            try:
                listener(reason)
            except Exception:
                logger.exception("tensor-parallel failure listener failed")

    @contextlib.contextmanager
    def failures(self, what: str) -> Iterator[None]:
        """A collective's error (a peer's closed connection, a timeout) as `DistributedError`, naming
        the rank that died when the watchdog knows it."""
        self.check()
        try:
            yield
        except (RuntimeError, OSError, pickle.UnpicklingError) as exc:
            if isinstance(exc, DistributedError):
                raise
            late = "timed out" in str(exc).lower()
            why = f"a rank did not answer within {step_timeout():g} s (CONVEYOR_TP_TIMEOUT): " if late else ""
            reason = self.dead_rank() or f"{what} on rank {self.rank} failed: {why}{exc}"
            self.fail(reason)
            raise DistributedError(self.failure or reason) from exc

    def dead_rank(self, wait_s: float = 2.0) -> str | None:
        """Which spawned rank has exited, and how (a collective usually fails a moment before the process
        is reaped); None when none has, or when the ranks are not this process's children."""
        deadline = time.monotonic() + (wait_s if self.watched else 0.0)
        while True:
            for rank, process in self.watched.items():
                if process.exitcode is not None:
                    return describe_exit(rank, process.pid, process.exitcode)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def watch(self, processes: dict[int, Any]) -> None:
        """Rank 0: a daemon thread that marks the group failed as soon as one of `processes` (rank ->
        multiprocessing.Process) exits while the group is open."""
        self.watched = processes

        def run() -> None:
            sentinels = {p.sentinel: (rank, p) for rank, p in processes.items()}
            ready = wait(list(sentinels))
            rank, process = sentinels[ready[0]]
            process.join(1)
            self.fail(describe_exit(rank, process.pid, process.exitcode))

        threading.Thread(target=run, name="conveyor-tp-watchdog", daemon=True).start()

    def destroy(self) -> None:
        """Leave the group (after the others were told to stop, or after a failure)."""
        self.closed = True
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def watch_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """A spawned rank: exit at once when the process that spawned it (rank 0) is gone, whatever this
    rank is waiting for (a daemon thread polls the parent id)."""
    def run() -> None:
        while True:
            threading.Event().wait(interval_s)
            if os.getppid() != parent_pid:
                logger.error("rank 0 (pid %d) is gone: this rank exits", parent_pid)
                os._exit(1)

    threading.Thread(target=run, name="conveyor-tp-parent", daemon=True).start()
