"""Where each local replica runs: its share of the cores (pinned, no oversubscription) or its own GPU.

On CPU every replica gets `threads` cores of its own out of the cores this process may use
(`os.sched_getaffinity`): replica i is pinned to the i-th run of `threads` of them and its torch runs
`threads` intra-op threads (`OMP_NUM_THREADS`). Two replicas that share a core slow each other down
about tenfold at their barriers (docs/design/cpu-kernels.md, "Shared machines"), so asking for more
threads than there are cores is an error before anything starts, not a warning. On CUDA replica i sees
only GPU i (`CUDA_VISIBLE_DEVICES`).

A replica split over `ranks` tensor-parallel processes (`--tensor-parallel-size`) takes `ranks` times
its threads in cores (its launcher gives each rank the replica's cores divided by the ranks), or
`ranks` GPUs of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One local replica's resources: the CPUs it is pinned to and its thread count, or its GPU."""

    index: int
    cpus: tuple[int, ...]
    threads: int
    gpus: tuple[int, ...] = ()

    def env(self) -> dict[str, str]:
        """The environment variables that give the replica process its share."""
        env = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        return env

    def describe(self) -> str:
        where = (f"GPU {','.join(map(str, self.gpus))}" if self.gpus else f"CPUs {','.join(map(str, self.cpus))}")
        return f"replica {self.index}: {where}, {self.threads} thread(s)"


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    return sorted(os.sched_getaffinity(0))


def plan_placement(replicas: int, threads: int | None = None, *, gpus: int = 0, ranks: int = 1,
                   cpus: list[int] | None = None) -> list[Placement]:
    """Resources for `replicas` local replicas of `ranks` tensor-parallel processes each. On CPU (`gpus`
    = 0): `threads` per process (default: the cores divided evenly), each replica pinned to `ranks` x
    `threads` cores of its own; more than there are raises ValueError. With GPUs: `ranks` each (more
    than are visible raises); `threads` defaults to the cores divided evenly."""
    cpus = usable_cpus() if cpus is None else cpus
    if replicas < 1:
        return []
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    split = f" x {ranks} tensor-parallel ranks" if ranks > 1 else ""
    if gpus:
        if replicas * ranks > gpus:
            raise ValueError(f"{replicas} local replicas{split} need {replicas * ranks} GPUs, one a process; "
                             f"{gpus} visible")
        per = threads or max(1, len(cpus) // (replicas * ranks))
        return [Placement(i, tuple(cpus), per, gpus=tuple(range(i * ranks, (i + 1) * ranks)))
                for i in range(replicas)]
    per = threads if threads is not None else len(cpus) // (replicas * ranks)
    width = per * ranks
    if per < 1 or replicas * width > len(cpus):
        asked = f"{replicas} replicas{split} x {per} thread(s)" if per else f"{replicas} replicas{split}"
        raise ValueError(f"{asked} need {replicas * ranks * max(per, 1)} cores, and this process may use "
                         f"{len(cpus)} (CPUs {','.join(map(str, cpus))}): lower --data-parallel-size"
                         f"{', --tensor-parallel-size' if ranks > 1 else ''} or --threads, so that processes "
                         "do not share cores")
    return [Placement(i, tuple(cpus[i * width:(i + 1) * width]), per) for i in range(replicas)]
