"""Where each local replica runs: its share of the cores (pinned, no oversubscription) or its own GPU.

On CPU every replica gets `threads` cores of its own out of the cores this process may use
(`os.sched_getaffinity`): replica i is pinned to the i-th run of `threads` of them and its torch runs
`threads` intra-op threads (`OMP_NUM_THREADS`). Two replicas that share a core slow each other down
about tenfold at their barriers (DEVELOPERS.md, "Timing on a shared machine"), so asking for more
threads than there are cores is an error before anything starts, not a warning. On CUDA replica i sees
only GPU i (`CUDA_VISIBLE_DEVICES`).
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
    gpu: int | None = None

    def env(self) -> dict[str, str]:
        """The environment variables that give the replica process its share."""
        env = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        return env

    def describe(self) -> str:
        where = f"GPU {self.gpu}" if self.gpu is not None else f"CPUs {','.join(map(str, self.cpus))}"
        return f"replica {self.index}: {where}, {self.threads} thread(s)"


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    return sorted(os.sched_getaffinity(0))


def plan_placement(replicas: int, threads: int | None = None, *, gpus: int = 0,
                   cpus: list[int] | None = None) -> list[Placement]:
    """Resources for `replicas` local replicas. On CPU (`gpus` = 0): `threads` each (default: the cores
    divided evenly), pinned to disjoint cores; `replicas` x `threads` over the cores raises ValueError.
    With GPUs: one each (more replicas than GPUs raises); `threads` defaults to the cores divided evenly."""
    cpus = usable_cpus() if cpus is None else cpus
    if replicas < 1:
        return []
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if gpus:
        if replicas > gpus:
            raise ValueError(f"{replicas} local replicas need {replicas} GPUs, one each; {gpus} visible")
        per = threads or max(1, len(cpus) // replicas)
        return [Placement(i, tuple(cpus), per, gpu=i) for i in range(replicas)]
    per = threads if threads is not None else len(cpus) // replicas
    if per < 1 or replicas * per > len(cpus):
        asked = f"{replicas} replicas x {per} thread(s)" if per else f"{replicas} replicas"
        raise ValueError(f"{asked} need {replicas * max(per, 1)} cores, and this process may use {len(cpus)} "
                         f"(CPUs {','.join(map(str, cpus))}): lower --data-parallel-size or --threads, so that "
                         "replicas do not share cores")
    return [Placement(i, tuple(cpus[i * per:(i + 1) * per]), per) for i in range(replicas)]
