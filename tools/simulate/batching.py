"""Static versus continuous batching, step by step, on a queue of requests with known output lengths,
and the same queue replayed through Conveyor's real scheduler and KV allocator (no model).

Model. Every request is queued at step 0 and generates `length` tokens, one per step; a slot
holds one request; one step is one forward pass that gives every occupied slot one token. A
request that enters a slot at step `s` occupies steps `s .. s + length - 1` and frees the slot
after step `s + length - 1`, so the next request can use it from step `s + length` (the
step right after: no idle step in between). `steps` is the number of steps until the last
request finishes; the slots' busy fraction is `sum(lengths) / (steps * slots)`.

- Static batching: requests are taken in order, in groups of `slots`; a group runs until its
  longest request finishes, then the next group starts. steps = sum of the group maxima.
- Continuous (ideal): whenever a slot frees, the next waiting request takes it at the next step
  (a heap of slot free times). steps = the makespan of greedy list scheduling.
- Conveyor's scheduler: the same requests replayed through a real `FIFOScheduler` (or
  `PrefillFirstScheduler`) over a real `CachePool` / `FullAttentionCacheAllocator`, with no model.
  Each request has a 1-token prompt and `max_new_tokens = length`; the step that prefills the
  prompt samples the first output token, each later step decodes one more, so a request is
  scheduled in exactly `length` steps. `max_requests_per_batch = slots` plays the slots; token
  budget and cache are large enough never to bind and `safety_margin = 0`.

With the default figures (lengths [5, 50, 8, 12, 40, 3, 30, 7], 4 slots) this gives static 90 steps
(155/360 = 43% busy) and continuous 50 steps (155/200 = 78%); percentages are printed to the whole
percent (`:.0%`). The command line is in `cli.py`, the plan past one process in `scaling.py`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
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

    from conveyor.cache.allocator import FullAttentionCacheAllocator
    from conveyor.cache.pool import NUM_RESERVED_CHUNKS, CachePool
    from conveyor.config import ContinuousBatchingConfig
    from conveyor.request import Request, RequestState
    from conveyor.sampling_params import SamplingParams
    from conveyor.sched.scheduler import make_scheduler

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
