"""Static versus continuous batching, step by step: the seeds' simulation (SPEC section 1).

`python -m conveyor.bench simulate [--lengths 5,50,8,12,40,3,30,7] [--slots 4] [--out F.json] [--plot F.png]`
`... simulate --replicas 1,2,4 --tensor-parallel-sizes 1,2,4 [--measure-allreduce]`: the same workload on N
replicas of T ranks each, timed with the cost model of `scaling.py` (planning past one process).

Model. Every request is queued at step 0 and generates `length` tokens, one per step; a slot
holds one request; one step is one forward pass that gives every occupied slot one token. A
request that enters a slot at step `s` occupies steps `s .. s + length - 1` and frees the slot
after step `s + length - 1`, so the next request can use it from step `s + length` (the
step right after: no idle step in between). `steps` is the number of steps until the last
request finishes; the slots' busy fraction is `sum(lengths) / (steps * slots)`.

- Static batching: requests are taken in order, in groups of `slots`; a group runs until its
  longest request finishes, then the next group starts. steps = sum of the group maxima.
- Continuous (ideal): whenever a slot frees, the next waiting request takes it at the next step
  (the seeds' heap of slot free times). steps = the makespan of greedy list scheduling.
- Conveyor's scheduler: the same requests replayed through a real `FIFOScheduler` (or
  `PrefillFirstScheduler`) over a real `CachePool` / `FullAttentionCacheAllocator`, with no model.
  Each request has a 1-token prompt and `max_new_tokens = length`; the step that prefills the
  prompt samples the first output token, each later step decodes one more, so a request is
  scheduled in exactly `length` steps. `max_requests_per_batch = slots` plays the slots; token
  budget and cache are large enough never to bind and `safety_margin = 0`.

With the seeds' figures (lengths [5, 50, 8, 12, 40, 3, 30, 7], 4 slots) this gives static 90 steps
(155/360 = 43% busy) and continuous 50 steps (155/200 = 78%), the documented numbers; the naive
model above needs no adjustment. Percentages are printed like the seeds' script (`:.0%`).
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

DEFAULT_LENGTHS = (5, 50, 8, 12, 40, 3, 30, 7)
DEFAULT_SLOTS = 4

STATIC = "static"
CONTINUOUS = "continuous"
CONVEYOR = "conveyor"
LABELS = {STATIC: "static batching", CONTINUOUS: "continuous batching (ideal)",
          CONVEYOR: "conveyor scheduler"}


@dataclass
class Segment:
    """Request `request` (index into the lengths) occupied `slot` for steps `start .. start + length - 1`."""

    request: int
    slot: int
    start: int
    length: int

    @property
    def end(self) -> int:
        """First step after the request's last one."""
        return self.start + self.length


@dataclass
class Timeline:
    """One batching policy's run: steps, slot occupancy and who sat in which slot when."""

    name: str
    label: str
    slots: int
    steps: int
    busy_slot_steps: int
    segments: list[Segment] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def slot_steps(self) -> int:
        return self.steps * self.slots

    @property
    def busy_fraction(self) -> float:
        return self.busy_slot_steps / self.slot_steps if self.slot_steps else 0.0

    @property
    def mean_finish_step(self) -> float:
        """Mean over requests of the step count at which each produced its last token."""
        return sum(s.end for s in self.segments) / len(self.segments) if self.segments else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "slots": self.slots, "steps": self.steps,
                "busy_slot_steps": self.busy_slot_steps, "slot_steps": self.slot_steps,
                "busy_fraction": self.busy_fraction, "mean_finish_step": self.mean_finish_step,
                "segments": [asdict(s) for s in sorted(self.segments, key=lambda s: s.request)], **self.extra}


def check_inputs(lengths: Sequence[int], slots: int) -> list[int]:
    lengths = list(lengths)
    if not lengths:
        raise ValueError("need at least one request length")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths):
        raise ValueError(f"every length must be an integer >= 1, got {lengths}")
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    return lengths


def static_batching(lengths: Sequence[int], slots: int) -> Timeline:
    """Groups of `slots` requests in order; each group runs until its longest request finishes."""
    lengths = check_inputs(lengths, slots)
    segments, start = [], 0
    for g in range(0, len(lengths), slots):
        group = lengths[g:g + slots]
        segments += [Segment(g + j, j, start, n) for j, n in enumerate(group)]
        start += max(group)
    return Timeline(STATIC, LABELS[STATIC], slots, start, sum(lengths), segments)


def continuous_batching(lengths: Sequence[int], slots: int) -> Timeline:
    """Each request, in order, takes the slot that frees first (lowest slot index on ties)."""
    lengths = check_inputs(lengths, slots)
    free_at = [(0, slot) for slot in range(slots)]  # (first free step, slot), a heap
    segments = []
    for i, n in enumerate(lengths):
        start, slot = heapq.heappop(free_at)
        segments.append(Segment(i, slot, start, n))
        heapq.heappush(free_at, (start + n, slot))
    return Timeline(CONTINUOUS, LABELS[CONTINUOUS], slots, max(t for t, _ in free_at), sum(lengths), segments)


def replay_scheduler(lengths: Sequence[int], slots: int, *, scheduler_type: str = "fifo",
                     page_size: int = 16) -> Timeline:
    """Run the requests through Conveyor's real scheduler and allocator, with no model.

    After each `schedule()` every chunk's tokens are marked computed; a request whose whole
    sequence is in the cache gets one fake output token and becomes DECODING; one with
    `max_new_tokens` outputs is removed (its blocks freed). Slots are bookkeeping only: an admitted
    request takes the lowest free slot index, for the timeline.
    """
    import torch

    from ..cache.allocator import FullAttentionCacheAllocator
    from ..cache.pool import NUM_RESERVED_CHUNKS, CachePool
    from ..config import ContinuousBatchingConfig
    from ..request import Request, RequestState
    from ..sampling_params import SamplingParams
    from ..sched.scheduler import make_scheduler

    lengths = check_inputs(lengths, slots)
    # Enough blocks for every request at full length at once, so the cache never binds.
    num_blocks = sum(math.ceil((n + 1) / page_size) for n in lengths)
    config = ContinuousBatchingConfig(max_requests_per_batch=slots, max_batch_tokens=max(slots, 1) * 16,
                                      page_size=page_size, num_blocks=num_blocks, safety_margin=0.0,
                                      scheduler_type=scheduler_type)
    pool = CachePool(num_blocks + NUM_RESERVED_CHUNKS, page_size, num_layers=1, num_kv_heads=1, head_dim=1,
                     dtype=torch.float32, device=torch.device("cpu"))
    scheduler = make_scheduler(config, FullAttentionCacheAllocator(pool))
    requests = [Request(str(i), [1], SamplingParams(max_new_tokens=n, temperature=0)) for i, n in enumerate(lengths)]
    for r in requests:
        scheduler.add_request(r)
    index = {r.request_id: i for i, r in enumerate(requests)}

    slot_of: dict[int, int] = {}
    free_slots = list(range(slots))  # heap
    start_of: dict[int, int] = {}
    segments: list[Segment] = []
    steps = busy = max_batch = 0
    limit = sum(lengths) + len(lengths) + 1  # every step schedules at least one token, or we stop
    while scheduler.has_work():
        if steps >= limit:
            raise RuntimeError(f"scheduler replay did not finish within {limit} steps")
        out = scheduler.schedule()
        if not out.chunks:
            raise RuntimeError(f"scheduler scheduled nothing at step {steps} with work left "
                               f"(waiting {len(scheduler.waiting)}, active {len(scheduler.active)}, "
                               f"stalled {len(out.stalled)})")
        if len(out.chunks) > slots:
            raise RuntimeError(f"scheduler put {len(out.chunks)} requests in one step; the limit is {slots}")
        for chunk in out.chunks:
            i = index[chunk.request.request_id]
            if i not in slot_of:
                slot_of[i] = heapq.heappop(free_slots)
                start_of[i] = steps
        busy += len(out.chunks)
        max_batch = max(max_batch, len(out.chunks))
        for chunk in out.chunks:
            r = chunk.request
            r.num_computed_tokens += chunk.num_tokens
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(0)
                r.state = RequestState.DECODING
                if len(r.output_token_ids) >= r.params.max_new_tokens:
                    scheduler.remove(r)
                    r.state = RequestState.FINISHED
                    i = index[r.request_id]
                    segments.append(Segment(i, slot_of[i], start_of[i], steps + 1 - start_of[i]))
                    heapq.heappush(free_slots, slot_of[i])
        steps += 1
    for seg in segments:
        if seg.length != lengths[seg.request]:  # a request skipped a step, or a step gave it two tokens
            raise RuntimeError(f"request {seg.request} spanned {seg.length} steps for {lengths[seg.request]} tokens")
    label = f"{LABELS[CONVEYOR]} ({scheduler_type})"
    return Timeline(CONVEYOR, label, slots, steps, busy, segments,
                    extra={"scheduler_type": scheduler_type, "page_size": page_size, "num_blocks": num_blocks,
                           "max_batch_tokens": config.max_batch_tokens, "max_requests_in_a_step": max_batch})


def simulate(lengths: Sequence[int] = DEFAULT_LENGTHS, slots: int = DEFAULT_SLOTS, *, scheduler: bool = True,
             scheduler_type: str = "fifo") -> dict[str, Any]:
    """The report as a JSON-able dict: `systems` maps static / continuous / conveyor to `Timeline.to_dict()`."""
    lengths = check_inputs(lengths, slots)
    timelines = [static_batching(lengths, slots), continuous_batching(lengths, slots)]
    if scheduler:
        timelines.append(replay_scheduler(lengths, slots, scheduler_type=scheduler_type))
    static, continuous = timelines[0], timelines[1]
    return {
        "benchmark": "simulate",
        "lengths": lengths, "slots": slots, "num_requests": len(lengths), "total_tokens": sum(lengths),
        "systems": {t.name: t.to_dict() for t in timelines},
        "static_over_continuous_steps": static.steps / continuous.steps,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['num_requests']} requests, output lengths {report['lengths']} "
             f"({report['total_tokens']} tokens), {report['slots']} slots", ""]
    rows = [(s["label"], str(s["steps"]), f"{s['busy_fraction']:.0%}",
             f"{s['busy_slot_steps']}/{s['slot_steps']}", f"{s['mean_finish_step']:.1f}")
            for s in report["systems"].values()]
    header = ("policy", "steps", "slots busy", "busy/total", "mean finish step")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))  # noqa: E731
    lines += [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    lines += ["", f"static batching needs {report['static_over_continuous_steps']:.2f}x the steps of "
                  "continuous batching"]
    conv, ideal = report["systems"].get(CONVEYOR), report["systems"][CONTINUOUS]
    if conv is not None and conv["steps"] != ideal["steps"]:
        lines.append(f"NOTE: conveyor's scheduler took {conv['steps']} steps, the ideal continuous batching "
                     f"{ideal['steps']}")
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------
def _lengths(text: str) -> list[int]:
    import argparse

    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(parser: Any) -> None:
    from ..sched.scheduler import SCHEDULERS

    parser.add_argument("--lengths", type=_lengths, default=list(DEFAULT_LENGTHS),
                        help="comma-separated output lengths of the queued requests "
                             f"(default {','.join(map(str, DEFAULT_LENGTHS))})")
    parser.add_argument("--slots", type=int, default=DEFAULT_SLOTS,
                        help=f"sequences decoded together per step (default {DEFAULT_SLOTS})")
    parser.add_argument("--scheduler", choices=list(SCHEDULERS), default="fifo",
                        help="Conveyor scheduler to replay (default fifo)")
    parser.add_argument("--no-scheduler", action="store_true",
                        help="skip the replay through Conveyor's scheduler (no torch import)")
    parser.add_argument("--out", default=None, help="write the report (with every request's slot and steps) as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="draw the slot-occupancy timelines of static and continuous batching (needs matplotlib)")
    add_plan_arguments(parser.add_argument_group(
        "scaling plan (N replicas x T tensor-parallel ranks; cost model in conveyor/bench/scaling.py)"))


def add_plan_arguments(group: Any) -> None:
    from .scaling import DEFAULT_ROW_MS, DEFAULT_SHAPE, DEFAULT_STEP_MS

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
                       help="a two-rank all-reduce's fixed cost (default: measured on this machine, see DEVELOPERS.md)")
    group.add_argument("--allreduce-gbps", type=float, default=None, help="its bandwidth, GB/s")
    group.add_argument("--measure-allreduce", action="store_true",
                       help="time gloo all-reduces between two local ranks at the model's hidden size first")


def plan_from_args(args: Any, lengths: list[int]) -> dict[str, Any] | None:
    """The scaling plan's report, or None when no --replicas / --tensor-parallel-sizes were given."""
    if args.replicas is None and args.tensor_parallel_sizes is None:
        return None
    from .allreduce import measure
    from .scaling import DEFAULT_ALLREDUCE, DEFAULT_SHAPE, CostModel, plan_report

    shape = dict(DEFAULT_SHAPE)
    if args.model is not None:
        from ..models.loader import read_config

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
        from .plot import PlotDependencyError, require_matplotlib

        try:
            require_matplotlib()
        except PlotDependencyError as exc:
            raise SystemExit(f"error: {exc}") from None
    report = simulate(args.lengths, args.slots, scheduler=not args.no_scheduler, scheduler_type=args.scheduler)
    print(format_report(report))
    scaling = plan_from_args(args, args.lengths)
    if scaling is not None:
        from .scaling import format_plan

        report["plan"] = scaling
        print("\n" + format_plan(scaling, args.slots))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    if args.plot:
        from .plot import plot_timeline

        plot_timeline([report["systems"][STATIC], report["systems"][CONTINUOUS]], args.plot)
        print(f"Wrote {args.plot}")
    conv = report["systems"].get(CONVEYOR)
    return 1 if conv is not None and conv["steps"] != report["systems"][CONTINUOUS]["steps"] else 0
