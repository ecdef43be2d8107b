"""Reports of `conveyor bench serve`: vllm's result table, the sweep table, and plots."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .serve_cache import format_cache
from .serve_faults import format_fault
from .serve_stats import METRICS


def _num(value: Any, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def format_run(run: dict[str, Any]) -> str:
    """vllm's result table for one run."""
    rows: list[str] = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        rows.append(f"{label:<40} {value:<10}".rstrip())

    row("Successful requests:", run["completed"])
    row("Failed requests:", run["failed"])
    if run.get("max_concurrency"):
        row("Maximum request concurrency:", run["max_concurrency"])
    rate = run["request_rate"]
    row("Request rate configured (RPS):", "inf" if rate == "inf" else f"{rate:.2f}")
    row("Benchmark duration (s):", f"{run['duration']:.2f}")
    input_note = "" if run["input_tokens_reported"] == run["completed"] else \
        f" (usage of {run['input_tokens_reported']}/{run['completed']})"
    row("Total input tokens:", f"{run['total_input_tokens']}{input_note}")
    output_note = "" if run["output_tokens_from_usage"] == run["completed"] else \
        f" (usage of {run['output_tokens_from_usage']}/{run['completed']}, chunks counted)"
    row("Total generated tokens:", f"{run['total_output_tokens']}{output_note}")
    row("Request throughput (req/s):", f"{run['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{run['output_throughput']:.2f}")
    row("Total Token throughput (tok/s):", f"{run['total_token_throughput']:.2f}")
    row("Peak concurrent requests:", run["max_concurrent_requests"])
    for name, title, short in METRICS:
        rows.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", _num(run[f"{stat}_{name}_ms"]))
    if run.get("prefix_cache"):
        rows.append("{s:{c}^{n}}".format(s="Server prefix cache (per replica)", n=50, c="-"))
        rows += format_cache(run["prefix_cache"])
    if run.get("fault"):
        rows.append("{s:{c}^{n}}".format(s="Replica killed (SIGKILL)", n=50, c="-"))
        rows += format_fault(run["fault"])
    if run["errors"]:
        rows.append("{s:{c}^{n}}".format(s="Errors", n=50, c="-"))
        for err, count in sorted(run["errors"].items(), key=lambda kv: -kv[1])[:10]:
            rows.append(f"{count:>5} x {err[:200]}")
    rows.append("=" * 50)
    return "\n".join(rows)


def format_sweep(runs: Sequence[dict[str, Any]]) -> str:
    """One line per request rate."""
    head = (f"{'rate':>8} {'ok':>5} {'fail':>5} {'dur s':>8} {'req/s':>7} {'out tok/s':>10} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8} {'E2E p99':>9}   (latencies in ms)")
    lines = ["Request-rate sweep", head]
    for r in runs:
        rate = r["request_rate"]
        lines.append(f"{rate if rate == 'inf' else format(rate, 'g'):>8} {r['completed']:>5} {r['failed']:>5} "
                     f"{r['duration']:>8.2f} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
                     f"{_num(r['median_ttft_ms'], '.1f'):>9} {_num(r['p99_ttft_ms'], '.1f'):>9} "
                     f"{_num(r['median_tpot_ms'], '.1f'):>9} {_num(r['p99_itl_ms'], '.1f'):>8} "
                     f"{_num(r['p99_e2el_ms'], '.1f'):>9}")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    wl, server = report["workload"], report.get("server")
    parts = [f"Serve benchmark: {report['api_url']}, model {report['model_id']}, workload {wl['name']} "
             f"({wl['num_requests']} requests)"]
    if server:  # set by run_from_args: what served, as far as the client can know
        flags = " ".join(report["environment"]["cpu_flags"]) or "unknown"
        parts[0] += ("\n" + (f"Server: Conveyor launched for the run ({server['dtype']}, weights "
                              f"{server['quantization']}); CPU flags {flags}" if server["launched"] else
                              f"Server: external, in its own dtype and weights; this machine's CPU flags {flags}"))
    for run in report["results"]:
        parts.append(format_run(run))
    if len(report["results"]) > 1:
        parts.append(format_sweep(report["results"]))
    return "\n\n".join(parts)


def plot_report(report: dict[str, Any], path: str | os.PathLike[str], label: str | None = None) -> Path:
    """A sweep: output tok/s and p99 TTFT against request rate. One run: latency bars (ms)."""
    from . import plot

    runs = report["results"]
    if len(runs) > 1:
        points = [{"request_rate": math.inf if r["request_rate"] == "inf" else r["request_rate"],
                   "output_tok_per_s": r["output_throughput"],
                   "ttft_p99_s": (r["p99_ttft_ms"] or 0.0) / 1000.0,
                   "system": label or report["model_id"]} for r in runs]
        return plot.plot_rate_sweep(points, path, title=f"{label or report['model_id']} via {report['api_url']}: "
                                                        f"throughput and p99 TTFT vs request rate")
    run = runs[0]
    metrics = {short: {stat: run[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p99")
                       if run[f"{stat}_{name}_ms"] is not None}
               for name, _, short in METRICS}
    metrics = {k: v for k, v in metrics.items() if v}
    if not metrics:
        raise ValueError("no successful requests: nothing to plot")
    rate = run["request_rate"]
    return plot.plot_latency_percentiles(
        metrics, path, unit="ms",
        title=f"{label or report['model_id']}: latency at {rate} req/s ({run['completed']} requests)")
