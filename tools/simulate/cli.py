"""`python -m tools.simulate`: static versus continuous batching on a queue of output lengths (and its
replay through Conveyor's scheduler, `batching.py`), optionally planned over N replicas x T
tensor-parallel ranks (`scaling.py`).

Exit code 1 if Conveyor's scheduler needs a different number of steps than ideal continuous batching.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from conveyor.bench.plot import PlotDependencyError, require_matplotlib
from conveyor.models.loader import read_config
from conveyor.sched.scheduler import SCHEDULERS

from .allreduce import measure
from .batching import CONTINUOUS, CONVEYOR, DEFAULT_LENGTHS, DEFAULT_SLOTS, STATIC, format_report, simulate
from .scaling import (DEFAULT_ALLREDUCE, DEFAULT_ROW_MS, DEFAULT_SHAPE, DEFAULT_STEP_MS, CostModel, format_plan,
                      plan_report)
from .timeline_plot import plot_timeline


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(parser: Any) -> None:
    parser.add_argument("--lengths", type=_lengths, default=list(DEFAULT_LENGTHS),
                        help="comma-separated output lengths of the queued requests "
                             f"(default {','.join(map(str, DEFAULT_LENGTHS))})")
    parser.add_argument("--slots", type=int, default=DEFAULT_SLOTS,
                        help=f"sequences decoded together per step (default {DEFAULT_SLOTS})")
    parser.add_argument("--scheduler", choices=list(SCHEDULERS), default="fifo",
                        help="Conveyor scheduler to replay (default fifo)")
    parser.add_argument("--no-scheduler", action="store_true",
                        help="skip the replay through Conveyor's scheduler")
    parser.add_argument("--out", default=None, help="write the report (with every request's slot and steps) as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw the slot-occupancy timelines of static and continuous batching (needs matplotlib)")
    add_plan_arguments(parser.add_argument_group(
        "scaling plan (N replicas x T tensor-parallel ranks; cost model in tools/simulate/scaling.py)"))


def add_plan_arguments(group: Any) -> None:
    group.add_argument("--replicas", type=_lengths, default=None, help="replica counts to plan, e.g. 1,2,4")
    group.add_argument("--tensor-parallel-sizes", type=_lengths, default=None, help="TP degrees to plan, e.g. 1,2,4")
    group.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS,
                       help=f"one process's decode step at one row, ms (default {DEFAULT_STEP_MS}: the built-in model)")
    group.add_argument("--row-ms", type=float, default=DEFAULT_ROW_MS,
                       help=f"what each more row adds to it, ms (default {DEFAULT_ROW_MS})")
    group.add_argument("--model", default=None,
                       help="take hidden size, layers and vocabulary from this model's config (default: the "
                            "built-in model's; or give them below)")
    for name, value in DEFAULT_SHAPE.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    group.add_argument("--allreduce-latency-us", type=float, default=None,
                       help="a two-rank all-reduce's fixed cost (default: gloo between two local ranks, scaling.py)")
    group.add_argument("--allreduce-gbps", type=float, default=None, help="its bandwidth, GB/s")
    group.add_argument("--measure-allreduce", action="store_true",
                       help="time gloo all-reduces between two local ranks at the model's hidden size first")


def plan_from_args(args: Any, lengths: list[int]) -> dict[str, Any] | None:
    """The scaling plan's report, or None when no --replicas / --tensor-parallel-sizes were given."""
    if args.replicas is None and args.tensor_parallel_sizes is None:
        return None
    shape = dict(DEFAULT_SHAPE)
    if args.model is not None:
        config = read_config(args.model)
        shape |= {"hidden_size": config.hidden_size, "num_layers": config.num_hidden_layers,
                  "vocab_size": config.vocab_size}
    shape |= {k: getattr(args, k) for k in DEFAULT_SHAPE if getattr(args, k) is not None}
    dtype = "bfloat16" if shape["act_bytes"] == 2 else "float32"
    fit = measure(shape["hidden_size"], dtype) if args.measure_allreduce else DEFAULT_ALLREDUCE
    given = {k: v for k, v in (("latency_us", args.allreduce_latency_us), ("gbps", args.allreduce_gbps))
             if v is not None}
    if given:
        fit = replace(fit, **given, source="given")
    model = CostModel(**shape, step_ms=args.step_ms, row_ms=args.row_ms, allreduce=fit)
    return plan_report(lengths, args.slots, args.replicas or [1], args.tensor_parallel_sizes or [1], model)


def run_from_args(args: Any) -> int:
    if args.slots < 1:
        raise SystemExit(f"error: --slots must be >= 1, got {args.slots}")
    if args.plot:
        try:
            require_matplotlib()
        except PlotDependencyError as exc:
            raise SystemExit(f"error: {exc}") from None
    report = simulate(args.lengths, args.slots, scheduler=not args.no_scheduler, scheduler_type=args.scheduler)
    print(format_report(report))
    scaling = plan_from_args(args, args.lengths)
    if scaling is not None:
        report["plan"] = scaling
        print("\n" + format_plan(scaling, args.slots))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    if args.plot:
        plot_timeline([report["systems"][STATIC], report["systems"][CONTINUOUS]], args.plot)
        print(f"Wrote {args.plot}")
    conv = report["systems"].get(CONVEYOR)
    return 1 if conv is not None and conv["steps"] != report["systems"][CONTINUOUS]["steps"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulation (and the plan, when asked); returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.simulate",
        description="Simulate static and continuous batching of requests with given output lengths on a number of "
                    "slots, and replay them through Conveyor's real scheduler and KV allocator (no model): steps until "
                    "all finish and the slots' busy fraction. Exit code 1 if Conveyor's scheduler needs a different "
                    "number of steps than ideal continuous batching.")
    add_arguments(parser)
    return run_from_args(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
