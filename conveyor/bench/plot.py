"""PNG plots of benchmark results (matplotlib, an optional dependency: `pip install conveyor[bench]`).

matplotlib is imported inside the functions, so importing this module costs nothing and works
without it; a plot function called without matplotlib raises `PlotDependencyError` (an
ImportError) saying what to install. Figures are drawn on `matplotlib.figure.Figure` objects,
never through pyplot: no GUI backend is touched and no global figure state is left behind.

Every function takes plain dicts (JSON-able: a report read back from `--out` works) and a path,
writes one PNG there and returns the path.

- `plot_throughput(report, path)`: a `throughput` report. Keys read:
  `report["systems"][name]["output_tok_per_s"]` and `["total_tok_per_s"]` for every system (in
  order; the first is the reference, normally "conveyor"); optional `report["ratios"][name]`
  (reference output tok/s over that system's; computed from the systems when missing);
  optional `report["workload"]["name"]`, `report["model"]["path"]`, `report["model"]["device"]`
  for the title.
- `plot_latency_percentiles(metrics, path)`: one panel per metric, a bar per statistic. `metrics` maps a
  metric name (e.g. "ttft_s", "tpot_s", "e2e_latency_s") to either a dict of statistics
  (`{"mean": x, "median": y, "p99": z}`; other keys are ignored, missing ones are skipped) or a
  list of raw samples, summarised here. `stats` chooses the bars (default mean, median, p99);
  `unit` labels the y axis (default "s").
- `plot_rate_sweep(results, path)`: throughput and p99 TTFT against request rate, two y axes.
  `results` is a list of dicts, one per (system, rate) point: `request_rate` (requests/s; `inf`
  or None = all requests at once, drawn at the right end), `output_tok_per_s`, `ttft_p99_s`
  (seconds), optional `system` (name; one pair of lines per system, default "conveyor").
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install matplotlib  (or: pip install 'conveyor[bench]')"
DEFAULT_STATS = ("mean", "median", "p99")


class PlotDependencyError(ImportError):
    """matplotlib is needed for plots and is not installed."""


def require_matplotlib() -> Any:
    """Import matplotlib or raise PlotDependencyError naming the package to install."""
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise PlotDependencyError(f"plots need matplotlib, which is not installed ({exc}); install it with: "
                                  f"{INSTALL_HINT}") from exc
    return matplotlib


def new_figure(width: float, height: float) -> Any:
    """A pyplot-free figure in the plots' size and layout (tools/simulate draws its timelines on one too)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def save_png(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Write `fig` as a PNG at `path`, creating its folder."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


# -- throughput -----------------------------------------------------------------------------------
def plot_throughput(report: Mapping[str, Any], path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Output and total tok/s per system, bars labelled with their values and the reference's ratio."""
    systems = report.get("systems") or {}
    if not systems:
        raise ValueError("the throughput report has no systems to plot")
    names = list(systems)
    labels = {"conveyor": "conveyor", "hf_generate_batch": "hf generate_batch", "hf_generate": "hf generate"}
    ref = names[0]
    out = [float(systems[n]["output_tok_per_s"]) for n in names]
    total = [float(systems[n]["total_tok_per_s"]) for n in names]
    ratios = dict(report.get("ratios") or {})

    fig = new_figure(max(6.0, 1.9 * len(names) + 2.5), 4.6)
    ax = fig.subplots()
    width = 0.38
    xs = range(len(names))
    bars_out = ax.bar([x - width / 2 for x in xs], out, width, label="output tok/s", color="#1f77b4")
    bars_tot = ax.bar([x + width / 2 for x in xs], total, width, label="total tok/s (prompt + output)",
                      color="#aec7e8")
    ax.bar_label(bars_out, labels=[_fmt(v) for v in out], padding=2, fontsize=8)
    ax.bar_label(bars_tot, labels=[_fmt(v) for v in total], padding=2, fontsize=8)
    top = max(out + total) or 1.0
    for x, name, o, t in zip(xs, names, out, total):
        if name == ref:
            text = "reference" if len(names) > 1 else ""
        else:
            r_out = ratios.get(name)
            if r_out is None and o:
                r_out = out[0] / o
            r_tot = total[0] / t if t else None
            text = (f"{labels.get(ref, ref)} is\n"
                    f"{'n/a' if r_out is None else f'{r_out:.2f}x'} output, "
                    f"{'n/a' if r_tot is None else f'{r_tot:.2f}x'} total")
        ax.text(x, top * 1.1, text, ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.35)
    ax.set_xticks(list(xs), [labels.get(n, n) for n in names])
    ax.set_ylabel("tokens / s")
    ax.legend(loc="upper right", fontsize=8)
    if title is None:
        workload = (report.get("workload") or {}).get("name")
        model = report.get("model") or {}
        parts = [f"workload {workload}" if workload else None,
                 Path(str(model["path"])).name if model.get("path") else None,
                 model.get("device")]
        title = "Offline throughput" + ("\n" + ", ".join(p for p in parts if p) if any(parts) else "")
    ax.set_title(title, fontsize=10)
    return save_png(fig, path)


# -- latency percentiles --------------------------------------------------------------------------
def summarize(samples: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 (linear interpolation, numpy's default) of raw samples."""
    values = sorted(float(v) for v in samples)
    if not values:
        raise ValueError("no samples to summarise")

    def pct(q: float) -> float:
        pos = (len(values) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        return values[lo] + (values[hi] - values[lo]) * (pos - lo)

    return {"mean": sum(values) / len(values), "median": pct(50), "p90": pct(90), "p99": pct(99)}


def plot_latency_percentiles(metrics: Mapping[str, Mapping[str, float] | Sequence[float]],
                             path: str | os.PathLike[str], *, stats: Sequence[str] = DEFAULT_STATS,
                             unit: str = "s", title: str | None = None) -> Path:
    """A panel per metric (each with its own y scale: TTFT and per-token latency differ by orders of
    magnitude), a bar per statistic (mean / median / p99 by default), values on the bars."""
    if not metrics:
        raise ValueError("no latency metrics to plot")
    table = {name: (dict(v) if isinstance(v, Mapping) else summarize(v)) for name, v in metrics.items()}
    require_matplotlib()
    from matplotlib import colormaps

    colors = colormaps["tab10"]
    fig = new_figure(max(4.0, 2.6 * len(table) + 0.8), 3.8)
    axes = fig.subplots(1, len(table), squeeze=False)[0]
    for ax, (name, values) in zip(axes, table.items()):
        shown = [(k, stat, float(values[stat])) for k, stat in enumerate(stats) if stat in values]
        bars = ax.bar([stat for _, stat, _ in shown], [v for _, _, v in shown],
                      color=[colors(k % colors.N) for k, _, _ in shown])
        ax.bar_label(bars, labels=[_fmt(v) for _, _, v in shown], padding=2, fontsize=8)
        ax.set_ylim(0, (max((v for _, _, v in shown), default=0.0) or 1.0) * 1.18)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_ylabel(unit)
    fig.suptitle(title or "Latency: " + ", ".join(stats), fontsize=10)
    return save_png(fig, path)


# -- throughput and TTFT against request rate -----------------------------------------------------
def plot_rate_sweep(results: Sequence[Mapping[str, Any]], path: str | os.PathLike[str],
                    title: str | None = None) -> Path:
    """Output tok/s (left axis, solid) and p99 TTFT (right axis, dashed) against request rate."""
    if not results:
        raise ValueError("no serve results to plot")

    def rate(r: Mapping[str, Any]) -> float:
        v = r.get("request_rate")
        return math.inf if v is None else float(v)

    finite = [rate(r) for r in results if math.isfinite(rate(r))]
    # geometric sweeps (1, 2, 4, ... req/s) read better on a log axis
    log = len(finite) > 1 and min(finite) > 0 and max(finite) / min(finite) >= 8
    inf_x = ((max(finite) * (2 if log else 1.25) if finite else 1.0)
             if any(not math.isfinite(rate(r)) for r in results) else None)
    fig = new_figure(7.5, 4.4)
    ax = fig.subplots()
    ax2 = ax.twinx()
    from matplotlib import colormaps

    systems = list(dict.fromkeys(str(r.get("system", "conveyor")) for r in results))
    cmap = colormaps["tab10"]
    for i, system in enumerate(systems):
        points = sorted(((rate(r), r) for r in results if str(r.get("system", "conveyor")) == system),
                        key=lambda p: p[0])
        xs = [inf_x if not math.isfinite(x) else x for x, _ in points]
        ax.plot(xs, [float(r["output_tok_per_s"]) for _, r in points], marker="o", color=cmap(i),
                label=f"{system} output tok/s")
        ax2.plot(xs, [float(r["ttft_p99_s"]) for _, r in points], marker="s", linestyle="--", color=cmap(i),
                 alpha=0.8, label=f"{system} p99 TTFT")
    if log:
        from matplotlib.ticker import NullLocator

        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ticks = sorted(set(finite))
    labels = [f"{x:g}" for x in ticks]
    if inf_x is not None:
        ticks.append(inf_x)
        labels.append("inf")
    ax.set_xticks(ticks, labels)
    ax.set_xlabel("request rate (requests / s)")
    ax.set_ylabel("output tokens / s")
    ax2.set_ylabel("p99 time to first token (s)")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], fontsize=8, loc="upper left")
    ax.set_title(title or "Throughput and p99 TTFT vs request rate", fontsize=10)
    return save_png(fig, path)
