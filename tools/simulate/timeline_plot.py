"""`plot_timeline(timelines, path)`: the simulation's slot-occupancy timelines as a PNG, one panel per
timeline (e.g. the report's `systems["static"]` and `systems["continuous"]`), drawn like the product's
plots (conveyor/bench/plot.py: matplotlib imported only when drawing, no pyplot).

Keys of each timeline: `slots` (int), `steps` (int), `segments` (list of `{"request": int, "slot": int,
"start": int, "length": int}`: request `request` held slot `slot` for steps `start .. start+length-1`);
optional `label` (str), `busy_fraction` (float, computed from the segments when missing). A `Timeline`
object works too, and so does a report read back from `--out`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conveyor.bench.plot import new_figure, require_matplotlib, save_png


def plot_timeline(timelines: Sequence[Mapping[str, Any]], path: str | os.PathLike[str],
                  title: str | None = None) -> Path:
    """One Gantt-like panel per timeline: a row per slot, a bar per request, coloured by request."""
    if not timelines:
        raise ValueError("no timelines to plot")
    timelines = [t.to_dict() if hasattr(t, "to_dict") else t for t in timelines]
    require_matplotlib()
    from matplotlib import colormaps

    requests = sorted({seg["request"] for t in timelines for seg in t["segments"]})
    cmap = colormaps["tab10" if len(requests) <= 10 else "tab20"]
    color = {r: cmap(i % cmap.N) for i, r in enumerate(requests)}
    max_steps = max(int(t["steps"]) for t in timelines) or 1
    heights = [max(1.0, 0.45 * int(t["slots"]) + 0.7) for t in timelines]
    fig = new_figure(10, sum(heights) + 0.8)
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    for ax, t in zip(axes, timelines):
        slots, steps = int(t["slots"]), int(t["steps"])
        busy = t.get("busy_fraction")
        if busy is None:
            busy = sum(s["length"] for s in t["segments"]) / (steps * slots) if steps else 0.0
        for seg in t["segments"]:
            y = slots - 1 - int(seg["slot"])  # slot 0 on top
            ax.broken_barh([(seg["start"], seg["length"])], (y - 0.4, 0.8), facecolors=color[seg["request"]],
                           edgecolors="white", linewidth=0.8)
            if seg["length"] >= max_steps / 40:  # label bars wide enough to hold it
                ax.text(seg["start"] + seg["length"] / 2, y, f"r{seg['request']}", ha="center", va="center",
                        fontsize=7, color="white", fontweight="bold")
        if steps:
            ax.axvline(steps, color="black", linewidth=1, linestyle="--")
        ax.set_yticks(range(slots), [f"slot {slots - 1 - y}" for y in range(slots)], fontsize=8)
        ax.set_ylim(-0.6, slots - 0.4)
        ax.set_xlim(0, max_steps * 1.02)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        label = t.get("label") or t.get("name") or ""
        ax.set_title(f"{label}: {steps} steps, slots busy {busy:.0%}", fontsize=10, loc="left")
    axes[-1].set_xlabel("step")
    if title is None:
        lengths = [seg["length"] for seg in sorted(timelines[0]["segments"], key=lambda s: s["request"])]
        title = f"Slot occupancy: {len(lengths)} requests, output lengths {lengths}"
    fig.suptitle(title, fontsize=10)
    return save_png(fig, path)
