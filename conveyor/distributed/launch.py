"""Starting the ranks of a tensor-parallel group, and stopping them.

On one machine, rank 0 (the process that builds the `LLM`) spawns the others with
torch.multiprocessing (the "spawn" start method: a fresh interpreter each, so the usual
`if __name__ == "__main__":` guard applies to scripts) and they meet through a TCPStore rank 0 opens
on a free loopback port. Across machines, torchrun starts every rank (one or more per node) and
each runs the same command; `launched_by_torchrun` sees its environment, the group forms from
`MASTER_ADDR`/`MASTER_PORT`, and the ranks other than 0 serve rank 0 (`worker.py`) instead of
running the command.

The group lives for the process (as torch.distributed's default group does): later `LLM`s with the
same tensor-parallel size load into the same ranks, which saves their start-up; a failed group is
replaced. At exit rank 0 tells the others to stop and waits for them.

Threads: on CPU every rank on a machine gets `cores / local ranks` intra-op threads (rank 0 too),
unless `OMP_NUM_THREADS` says otherwise: more would oversubscribe the cores.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ConfigError, DistributedError, readable_path
from .group import LOAD_TIMEOUT_S, RankGroup, describe_exit
from .worker import Stop, run_spawned_rank

logger = logging.getLogger("conveyor")

SPAWN_TIMEOUT_S = 600.0  # for a spawned rank to import and reach the group
RANK_PROCESS_NAME = "conveyor-tp-rank"  # + the rank: the name of each process `spawn` starts
REIMPORTED_EXIT_CODE = 78  # a spawned rank left at once: the user's script, re-run in it, built an LLM


class Launched:
    """The group this process belongs to, and (rank 0 on one machine) the processes it spawned."""

    def __init__(self, group: RankGroup, processes: dict[int, Any], how: str, local_ranks: int) -> None:
        self.group = group
        self.processes = processes
        self.how = how
        self.local_ranks = local_ranks  # ranks on this machine (sharing its cores and memory)


_CURRENT: Launched | None = None


def exit_if_spawned_rank() -> None:
    """Called as an `LLM` is built: in a rank `spawn` started, only the user's script can build one, re-run
    by multiprocessing's spawn start method (as `__mp_main__`, before the rank's own code) because its
    top level is not under `if __name__ == "__main__":`. The rank exits at once, quietly, with
    `REIMPORTED_EXIT_CODE`, and rank 0 raises the one error that says so (`wait_until_spawned`), instead
    of a second model load here and multiprocessing's traceback when this copy spawned ranks in turn."""
    if multiprocessing.current_process().name.startswith(RANK_PROCESS_NAME):  # named before the script runs
        os._exit(REIMPORTED_EXIT_CODE)


def reimport_message(rank: int) -> str:
    """What rank 0 says when a rank exited with `REIMPORTED_EXIT_CODE`: the cause and the fix, one line."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    script = f"module {spec.name}" if spec is not None and spec.name else \
        f"script {readable_path(getattr(main, '__file__', '?'))}"
    return (f"tensor-parallel rank {rank} re-ran the top level of your {script}, which builds an LLM: put that "
            "code under `if __name__ == \"__main__\":` (each rank starts as a new Python process that first "
            "imports the main script, as multiprocessing's spawn start method does)")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def threads_per_rank(local_ranks: int) -> int | None:
    """Intra-op threads for each of `local_ranks` ranks sharing this machine's cores; None = leave
    torch's choice (`OMP_NUM_THREADS` is set)."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, len(os.sched_getaffinity(0)) // local_ranks)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def tensor_parallel_group(world_size: int, device: torch.device) -> Launched:
    """This process's group of `world_size` ranks on `device`'s kind: the live one, or a new one."""
    global _CURRENT
    if _CURRENT is not None:
        current = _CURRENT.group
        if current.failure is None and current.world_size == world_size and current.device.type == device.type:
            return _CURRENT
        shutdown()
    _CURRENT = join_torchrun(world_size, device) if launched_by_torchrun() else spawn(world_size, device)
    atexit.register(shutdown)
    return _CURRENT


def join_torchrun(world_size: int, device: torch.device) -> Launched:
    """Join the group torchrun started: its `WORLD_SIZE` must be the tensor-parallel size."""
    given = int(os.environ["WORLD_SIZE"])
    if given != world_size:
        raise ConfigError(f"tensor_parallel_size={world_size}, but torchrun started {given} processes "
                          "(--nnodes x --nproc-per-node): make them equal")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = threads_per_rank(local_ranks)
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    group = RankGroup.join(rank, world_size, rank_device(device, local_rank))
    return Launched(group, {}, f"torchrun, rank {rank} of {world_size}", local_ranks)


def spawn(world_size: int, device: torch.device) -> Launched:
    """Rank 0 here, ranks 1.. spawned on this machine; they meet through a TCPStore on loopback."""
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, this machine has "
                          f"{torch.cuda.device_count()}")
    threads = threads_per_rank(world_size) if device.type == "cpu" else None
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    context = mp.get_context("spawn")
    processes = {}
    for rank in range(1, world_size):
        processes[rank] = context.Process(
            target=run_spawned_rank, name=f"{RANK_PROCESS_NAME}{rank}", daemon=True,
            args=(rank, world_size, store.port, str(rank_device(device, rank)), threads, os.getpid()))
        processes[rank].start()
    try:
        wait_until_spawned(store, processes)
    except BaseException:
        stop_processes(processes)
        raise
    if threads is not None:
        torch.set_num_threads(threads)
    group = RankGroup.join(0, world_size, rank_device(device, 0), store)
    group.watch(processes)
    how = f"{world_size} processes on this machine" + (f", {threads} thread(s) each" if threads else "")
    return Launched(group, processes, how, world_size)


def wait_until_spawned(store: dist.TCPStore, processes: dict[int, Any]) -> None:
    """Until every spawned rank has started (imported everything and reached the store); a rank that
    exits first is an error naming it, not a wait for the load timeout."""
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    keys = {rank: f"conveyor/spawned/{rank}" for rank in processes}
    while True:
        for rank, process in processes.items():
            if not process.is_alive():
                if process.exitcode == REIMPORTED_EXIT_CODE:
                    raise DistributedError(reimport_message(rank))
                raise DistributedError(describe_exit(rank, process.pid, process.exitcode) + " while starting")
        if store.check(list(keys.values())):
            return
        if time.monotonic() > deadline:
            raise DistributedError(f"tensor-parallel ranks did not start within {SPAWN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def stop_processes(processes: dict[int, Any], grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    for process in processes.values():
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes.values():
        if process.is_alive():
            process.kill()
            process.join(5)


def shutdown() -> None:
    """Stop this process's group: the other ranks told to stop (if it still works) and waited for."""
    global _CURRENT
    launched, _CURRENT = _CURRENT, None
    if launched is None:
        return
    group = launched.group
    if group.rank == 0 and group.failure is None:
        try:
            with group.lock:
                group.send(Stop())
        except DistributedError:
            pass
    group.closed = True
    stop_processes(launched.processes, grace_s=10.0 if group.failure is None else 0.0)
    group.destroy()
