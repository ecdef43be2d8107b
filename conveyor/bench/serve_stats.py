"""Statistics of `conveyor bench serve` runs, as vllm computes them.

Statistics are over the successful requests: mean, median, std, p90, p99 (numpy's default linear
interpolation), in milliseconds; throughputs divide by the whole run's duration (first request
scheduled to last response finished). JSON keys follow vllm's result files (`completed`,
`request_throughput`, `output_throughput`, `mean_ttft_ms`, `p99_itl_ms`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .serve_client import RequestResult

PERCENTILES = (90, 99)
METRICS = (("ttft", "Time to First Token", "TTFT"),
           ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"),
           ("e2el", "End-to-end Latency", "E2EL"))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics: numpy's
    default (`np.percentile(values, q)`), which vllm's figures use."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(float(v) for v in values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_ms(samples_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """mean, median, std (population, as numpy) and the given percentiles of samples in seconds,
    reported in milliseconds. Every value is None when there are no samples."""
    keys = ["mean", "median", "std"] + [f"p{q:g}" for q in percentiles]
    if not samples_s:
        return dict.fromkeys(keys)
    values = [float(v) * 1000.0 for v in samples_s]
    mean = sum(values) / len(values)
    out: dict[str, float | None] = {
        "mean": mean, "median": percentile(values, 50),
        "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))}
    for q in percentiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


def compute_metrics(results: Sequence[RequestResult], duration_s: float, *, request_rate: float = math.inf,
                    burstiness: float = 1.0, max_concurrency: int | None = None) -> dict[str, Any]:
    """vllm's serving metrics from the request results (statistics over the successful ones)."""
    ok = [r for r in results if r.success]
    samples = {"ttft": [r.ttft_s for r in ok],
               "tpot": [t for t in (r.tpot_s for r in ok) if t is not None],
               "itl": [x for r in ok for x in r.itl_s],
               "e2el": [r.latency_s for r in ok]}
    total_output = sum(r.output_tokens for r in ok)
    known_input = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    total_input = sum(known_input)
    out: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "input_tokens_reported": len(known_input),
        "output_tokens_from_usage": sum(r.output_tokens_source == "usage" for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s > 0 else 0.0,
        "max_concurrent_requests": peak_concurrency(ok),
    }
    for name, _, _ in METRICS:
        for stat, value in summarize_ms(samples[name]).items():
            out[f"{stat}_{name}_ms"] = value
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    out["errors"] = errors
    out["requests"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in results]
    return out


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (send to last token, half-open intervals), as vllm."""
    events = sorted([(r.start_s, 1) for r in results if r.latency_s is not None]
                    + [(r.start_s + r.latency_s, -1) for r in results if r.latency_s is not None])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
