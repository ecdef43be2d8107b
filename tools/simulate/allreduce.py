"""The all-reduce a tensor-parallel step makes, timed over gloo on this machine (`python -m tools.simulate
--measure-allreduce`): two ranks started as small torch-only processes (one thread each, a loopback
TCPStore), all-reduces of `[rows, hidden]` tensors in the model's activation dtype for a range of
row counts, medians; then a least-squares line `time = latency + bytes / bandwidth` through them.
That line is what `scaling.py` takes for a two-rank all-reduce; across machines, give your
network's figures instead (`--allreduce-latency-us`, `--allreduce-gbps`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta

ROWS = (1, 4, 16, 64, 256, 1024)


@dataclass
class AllReduceFit:
    """`latency_us + bytes / (gbps * 1e9)` seconds for one all-reduce between two ranks; the points it was
    fitted to as (bytes, median seconds)."""

    latency_us: float
    gbps: float
    points: list[tuple[int, float]] = field(default_factory=list)
    source: str = "given"

    def seconds(self, nbytes: float) -> float:
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)


def fit(points: list[tuple[int, float]], source: str) -> AllReduceFit:
    """Least squares of seconds on bytes; the slope floored so the bandwidth stays finite."""
    xs, ys = [float(b) for b, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0, 1e-15)
    intercept = max(my - slope * mx, 0.0)
    return AllReduceFit(intercept * 1e6, 1.0 / slope / 1e9, points, source)


# Each rank runs this alone (`python -c`), importing torch only: the ranks start in about a second
# instead of importing all of Conveyor. argv: rank, port, hidden, dtype, repeats, rows (comma-separated).
RANK_SCRIPT = """
import json, statistics, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
rank, port, hidden, dtype, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
points = []
for rows in map(int, sys.argv[6].split(",")):
    x = torch.randn(rows, hidden).to(getattr(torch, dtype))
    for _ in range(10):
        dist.all_reduce(x)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - started)
    points.append((x.numel() * x.element_size(), statistics.median(times)))
if rank == 0:
    print(json.dumps(points))
dist.destroy_process_group()
"""


def measure(hidden: int, dtype_name: str = "bfloat16", repeats: int = 100,
            rows: tuple[int, ...] = ROWS) -> AllReduceFit:
    """Time gloo all-reduces of `[rows, hidden]` between two local ranks (see the module docstring)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(store.port), str(hidden), dtype_name,
                               str(repeats), ",".join(map(str, rows))], stdout=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    try:
        out = [p.communicate(timeout=600)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    if any(p.returncode for p in ranks):
        raise RuntimeError(f"the all-reduce ranks failed (exit codes {[p.returncode for p in ranks]})")
    points = [(int(b), float(t)) for b, t in json.loads(out[0])]
    return fit(points, f"measured: gloo, 2 local ranks, 1 thread each, {dtype_name} [rows, {hidden}]")
