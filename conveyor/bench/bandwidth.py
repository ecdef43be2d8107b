"""Weight streaming: how many weight bytes a decode step reads, and how fast this machine reads memory.

At one row a decode step is memory-bound: every linear weight and the LM head are read once per
step, whatever the batch. `weight_bytes` counts those bytes as the model holds them (quantized
tensors at their stored size, dense ones at their element size; biases included; the embedding
lookup reads a few rows, so it is not counted). Divided by the step's model-forward + LM-head time
this gives the step's effective weight-streaming rate, which `read_bandwidth` puts next to the
machine's own: the median rate of `torch.sum` over a buffer bigger than the last-level cache, with
torch's threads. Where the weights themselves fit in that cache, a step may read them from it and
beat the DRAM figure; `weights_fit_in_cache` says so.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.kernels import host_memory
from conveyor.layers.linear import PackedLinear
from conveyor.layers.quantization.linear import QuantLinear, QuantMatmul

MIN_PROBE_BYTES = 256 * 2**20  # the probe buffer's floor; at least twice the last-level cache otherwise


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def linear_bytes(module: Any) -> int:
    """Bytes one call of a linear layer (or LM-head callable) reads from its weight and bias."""
    if isinstance(module, QuantLinear):
        return module.kernel.nbytes + _tensor_bytes(module.bias)
    if isinstance(module, QuantMatmul):
        return module.nbytes + _tensor_bytes(module.bias)
    if isinstance(module, (nn.Linear, PackedLinear)):
        return _tensor_bytes(module.weight) + _tensor_bytes(module.bias)
    raise TypeError(f"not a linear layer: {type(module).__name__}")


def weight_format(module: Any) -> str:
    """"Q4_1", "Q4_K+Q6_K", "bfloat16", ...: how a linear layer's weight is stored."""
    if isinstance(module, (QuantLinear, QuantMatmul)):
        segments = module.kernel.segments if isinstance(module, QuantLinear) else module.segments
        return "+".join(dict.fromkeys(s.type_name for s in segments))
    return str(module.weight.dtype).removeprefix("torch.")


def _is_linear(module: Any) -> bool:
    return isinstance(module, (nn.Linear, PackedLinear, QuantLinear))


def head_bytes(model: Any) -> tuple[int, str]:
    """(bytes, format) of what the LM head reads: its quantized kernel, its own linear, or the tied
    embedding's dense weight."""
    if isinstance(model.lm_head_fn, QuantMatmul):
        return linear_bytes(model.lm_head_fn), weight_format(model.lm_head_fn)
    if model.lm_head is not None:
        return linear_bytes(model.lm_head), weight_format(model.lm_head)
    weight = model.embed_tokens.weight
    return _tensor_bytes(weight), str(weight.dtype).removeprefix("torch.")


def weight_bytes(model: Any) -> dict[str, Any]:
    """Weight bytes one decode step reads: every linear of every layer, plus the LM head."""
    linears = [m for m in model.layers.modules() if _is_linear(m)]
    layers = sum(linear_bytes(m) for m in linears)
    head, head_format = head_bytes(model)
    return {"layers_bytes": layers, "lm_head_bytes": head, "total_bytes": layers + head,
            "layer_formats": sorted({weight_format(m) for m in linears}), "lm_head_format": head_format}


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache level (Linux sysfs), or None where it cannot be read."""
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def read_bandwidth(buffer_bytes: int | None = None, *, repeats: int = 5,
                   device: torch.device | str = "cpu") -> dict[str, Any]:
    """The machine's read bandwidth: median GB/s of `torch.sum` over an fp32 buffer of `buffer_bytes`
    (default: twice the last-level cache, at least `MIN_PROBE_BYTES`), with torch's threads, on the CPU on huge
    pages where the weights get them (`kernels.host_memory`): the bandwidth they can be read at."""
    device = torch.device(device)
    cache = last_level_cache_bytes() if device.type == "cpu" else None
    if buffer_bytes is None:
        buffer_bytes = max(MIN_PROBE_BYTES, 2 * (cache or 0))
    n = max(buffer_bytes // 4, 1)
    if device.type == "cpu":
        buffer = host_memory.empty((n,), torch.float32)
    else:
        buffer = torch.empty(n, dtype=torch.float32, device=device)
    buffer.fill_(1.0)  # pages touched here
    nbytes = buffer.numel() * 4
    samples = []
    for i in range(max(repeats, 1) + 1):  # the first pass is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        buffer.sum().item()
        seconds = time.perf_counter() - started
        if i:
            samples.append(nbytes / seconds / 1e9)
    return {"buffer_bytes": nbytes, "last_level_cache_bytes": cache, "threads": torch.get_num_threads(),
            "repeats": len(samples), "gb_per_s": statistics.median(samples), "samples_gb_per_s": samples}


def streaming_report(weights: dict[str, Any], step_s: float, bandwidth: dict[str, Any]) -> dict[str, Any]:
    """The step's effective weight-streaming rate (weights / `step_s`, its forward + LM head time) and its
    ratio to the measured read bandwidth."""
    rate = weights["total_bytes"] / step_s / 1e9
    cache = bandwidth["last_level_cache_bytes"]
    return {"weights": weights, "forward_lm_head_s": step_s, "gb_per_s": rate, "bandwidth": bandwidth,
            "fraction_of_bandwidth": rate / bandwidth["gb_per_s"],
            "weights_fit_in_cache": cache is not None and weights["total_bytes"] < cache}


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def format_streaming(s: dict[str, Any], target: float) -> list[str]:
    """Report lines for `streaming_report`, with the target fraction of the bandwidth."""
    w, b = s["weights"], s["bandwidth"]
    cache = b["last_level_cache_bytes"]
    lines = [f"Weight streaming: a step reads {_size(w['total_bytes'])} of weights (layers {_size(w['layers_bytes'])} "
             f"{'/'.join(w['layer_formats'])}, LM head {_size(w['lm_head_bytes'])} {w['lm_head_format']}; embedding "
             f"lookup not counted) in {s['forward_lm_head_s'] * 1e3:.2f} ms of model forward + LM head -> "
             f"{s['gb_per_s']:.1f} GB/s",
             f"  machine read bandwidth: {b['gb_per_s']:.1f} GB/s (torch.sum over a "
             f"{b['buffer_bytes'] / 2**20:.0f} MiB fp32 buffer, {b['threads']} threads, median of {b['repeats']}"
             + (f"; last-level cache {cache / 2**20:.0f} MiB)" if cache else ")"),
             f"  step / bandwidth: {s['fraction_of_bandwidth']:.0%}; target >= {target:.0%}: "
             f"{'met' if s['fraction_of_bandwidth'] >= target else 'NOT met'}"]
    if cache and b["buffer_bytes"] <= cache:
        lines.append("  note: the probe buffer fits in the last-level cache: the bandwidth above is the cache's, "
                     "not DRAM's")
    if s["weights_fit_in_cache"]:
        lines.append("  note: the weights fit in the last-level cache, so a step may read them from cache rather "
                     "than DRAM")
    return lines
