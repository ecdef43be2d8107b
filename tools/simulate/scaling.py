"""Planning past one process (`python -m tools.simulate --replicas ... --tensor-parallel-sizes ...`): the simulated
workload run by N replicas of a model split over T ranks each, with a stated cost model.

Model. A replica decodes like the continuous-batching simulation (`batching.py`: every request
queued at step 0, one token per step, `slots` rows at most), and the requests are dealt to the
replicas round-robin in queue order (what a router without prefix affinity does); replicas share
nothing, so the run takes as long as the slowest replica. A replica's step with `B` rows takes

    compute(B) / T + (2 * layers + 1) * allreduce(B * hidden * act_bytes, T) + gather(B, T)

- `compute(B) = step_ms + (B - 1) * row_ms`: one rank's decode step (weight streaming plus a cost per
  row), measured on one process (defaults: the built-in model's default mode on a 2-core machine,
  8.9 ms a step at one stream, ~2.2 ms more per row at chat64); it divides by T: each rank
  has its own device (a GPU, or a machine's cores), and the split is even (an uneven head split,
  `models.sharding`, makes the larger rank's attention the bound: not modelled);
- two all-reduces per layer (after attention and after the MLP) and one for the embedding, each
  a ring all-reduce of the step's activations: `(T - 1) * latency + 2 (T - 1) / T * bytes / bandwidth`,
  with `latency + bytes / bandwidth` the two-rank figure (measured with gloo, `allreduce.py`, or given
  for a network);
- the logits gather to rank 0: `(T - 1)` shards of `B * vocab / T` fp32 logits over one link.

Not modelled: prefill (every request has a one-token prompt, as in the batching simulation), the
command rank 0 sends each step, the router's own latency, the eager layer path TP runs on (the
native decode stack is off with TP: give `--step-ms` of that path), and waiting: ranks that share
busy cores arrive at a collective apart and wake late (on this 2-core machine an all-reduce inside
a real TP=2 step took 1.3 ms, ~4x the isolated figure: give `--allreduce-latency-us` from a profile
there). So it is a lower bound for such a machine, meant for separate devices and real networks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .allreduce import AllReduceFit

# The built-in SmolLM2-135M-Instruct: hidden size, layers, vocabulary; bf16 activations.
DEFAULT_SHAPE = {"hidden_size": 576, "num_layers": 30, "vocab_size": 49152, "act_bytes": 2}
DEFAULT_STEP_MS, DEFAULT_ROW_MS = 8.9, 2.2
# A two-rank gloo all-reduce on a 2-core machine, bf16 [rows, 576], load ~5 (`python -m tools.simulate
# --measure-allreduce`; inside a real tensor-parallel step it took ~4x this).
DEFAULT_ALLREDUCE = AllReduceFit(346.0, 0.81, source="default: gloo between 2 local ranks on the 2-core Xeon, "
                                                     "measured 2026-12-02")


@dataclass
class CostModel:
    hidden_size: int
    num_layers: int
    vocab_size: int
    act_bytes: int
    step_ms: float
    row_ms: float
    allreduce: AllReduceFit

    def allreduce_s(self, rows: int, tp: int) -> float:
        if tp == 1:
            return 0.0
        nbytes = rows * self.hidden_size * self.act_bytes
        return (tp - 1) * self.allreduce.latency_us * 1e-6 + 2 * (tp - 1) / tp * nbytes / (self.allreduce.gbps * 1e9)

    def gather_s(self, rows: int, tp: int) -> float:
        if tp == 1:
            return 0.0
        shard = rows * -(-self.vocab_size // tp) * 4
        return self.allreduce.latency_us * 1e-6 + (tp - 1) * shard / (self.allreduce.gbps * 1e9)

    def comm_s(self, rows: int, tp: int) -> float:
        return (2 * self.num_layers + 1) * self.allreduce_s(rows, tp) + self.gather_s(rows, tp)

    def step_s(self, rows: int, tp: int) -> float:
        return (self.step_ms + (rows - 1) * self.row_ms) * 1e-3 / tp + self.comm_s(rows, tp)


def replica_rows(lengths: Sequence[int], slots: int) -> list[int]:
    """Rows of each step of one replica's continuous batching (a freed slot is taken at the next step)."""
    free_at = [0] * slots
    ends: list[tuple[int, int]] = []  # (start, end) per request
    for n in lengths:
        start = heapq.heappop(free_at)
        ends.append((start, start + n))
        heapq.heappush(free_at, start + n)
    steps = max((e for _, e in ends), default=0)
    rows = [0] * steps
    for start, end in ends:
        for s in range(start, end):
            rows[s] += 1
    return rows


@dataclass
class PlanRow:
    replicas: int
    tp: int
    ranks: int
    step_ms_1: float  # a one-row step
    step_ms_full: float  # a step of `slots` rows
    comm_share_full: float  # the all-reduces' and gather's share of that step
    makespan_s: float
    tokens_per_s: float
    tokens_per_s_per_rank: float


def plan(lengths: Sequence[int], slots: int, replicas: Sequence[int], tps: Sequence[int],
         model: CostModel) -> list[PlanRow]:
    """Every (replicas, TP) combination run on the workload (module docstring)."""
    rows = []
    total = sum(lengths)
    for n in replicas:
        for tp in tps:
            dealt = [list(lengths[r::n]) for r in range(n)]
            makespan = max(sum(model.step_s(b, tp) for b in replica_rows(part, slots)) for part in dealt if part)
            full = model.step_s(slots, tp)
            rows.append(PlanRow(n, tp, n * tp, model.step_s(1, tp) * 1e3, full * 1e3, model.comm_s(slots, tp) / full,
                                makespan, total / makespan, total / makespan / (n * tp)))
    return rows


def plan_report(lengths: Sequence[int], slots: int, replicas: Sequence[int], tps: Sequence[int],
                model: CostModel) -> dict[str, Any]:
    return {"model": {k: v for k, v in asdict(model).items() if k != "allreduce"},
            "allreduce": {"latency_us": model.allreduce.latency_us, "gbps": model.allreduce.gbps,
                          "source": model.allreduce.source, "points": model.allreduce.points},
            "rows": [asdict(r) for r in plan(lengths, slots, replicas, tps, model)]}


def format_plan(report: dict[str, Any], slots: int) -> str:
    ar = report["allreduce"]
    lines = [f"Scaling plan (cost model in tools/simulate/scaling.py): all-reduce between 2 ranks = "
             f"{ar['latency_us']:.0f} us + bytes / {ar['gbps']:.2f} GB/s ({ar['source']})", ""]
    header = ("replicas x TP", "ranks", "step@1 ms", f"step@{slots} ms", "comm share", "makespan s", "tok/s",
              "tok/s/rank")
    body = [(f"{r['replicas']} x {r['tp']}", str(r["ranks"]), f"{r['step_ms_1']:.2f}", f"{r['step_ms_full']:.2f}",
             f"{r['comm_share_full']:.0%}", f"{r['makespan_s']:.3f}", f"{r['tokens_per_s']:.0f}",
             f"{r['tokens_per_s_per_rank']:.0f}") for r in report["rows"]]
    widths = [max(len(row[i]) for row in body + [header]) for i in range(len(header))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header] + body]
    return "\n".join(lines)
