"""The first two roofline measurements (tools/roofline/__init__.py): the model's own linear layers'
rates at M = batch rows, and one decode step over dense, contiguous K/V (the ceiling Conveyor's paged
step is set against)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.engine.step_buffers import LogitsBuffer
from conveyor.layers.attention import AttentionBackend, attend
from conveyor.layers.quantization.linear import QuantMatmul

from conveyor.bench.bandwidth import head_bytes, linear_bytes
from .expert_load import expert_shapes
from .peaks import linear_path, measure_peaks

MIN_SAMPLE_S = 2e-3  # matmul timing: repeat a call until one sample lasts at least this long


# -- timing helpers ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    """The median; NaN for no values (a report still prints)."""
    return statistics.median(values) if values else float("nan")


def _time_call(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds per call of `fn`; short calls are looped so one sample lasts >= MIN_SAMPLE_S."""
    for _ in range(max(warmup, 1)):
        fn()
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - started, 1e-7)
    inner = max(1, min(1000, math.ceil(MIN_SAMPLE_S / once)))
    samples = []
    for _ in range(max(repeats, 1)):
        sync(device)
        started = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        samples.append((time.perf_counter() - started) / inner)
    return median(samples)


# -- 1. matmul rate ---------------------------------------------------------------------------------
def model_device(model: Any) -> torch.device:
    """Where the model runs (its norms are dense parameters whatever the weight format)."""
    return next(model.parameters()).device


def linear_layers(model: Any, batch: int) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor], int, int, int,
                                                      int, int]]:
    """(name, the model's own callable, out_features, in_features, calls per decode step, weight bytes read
    per call, rows per call) of each distinct linear layer shape: the modules the forward calls
    (oneDNN-packed on CPU fp32, see `layers/linear.py`; quantized kernels, see `layers/quantization/`)
    and its LM head. A mixture-of-experts model's experts run at their share of the rows
    (`expert_load.expert_shapes`); its dense MLP shapes count only the layers that have one."""
    layer = model.layers[0]
    head = HeadCall(model)
    if isinstance(model.lm_head_fn, QuantMatmul):
        head_shape = (model.lm_head_fn.out_features, model.lm_head_fn.in_features)
    else:
        head_shape = tuple(model.lm_head_weight.shape)
    dense = [layer for layer in model.layers if hasattr(layer, "gate_up_proj")]
    calls = [(name, getattr(layer, name), model.num_layers, batch) for name in ("qkv_proj", "o_proj")]
    calls += [(name, getattr(dense[0], name), len(dense), batch) for name in ("gate_up_proj", "down_proj") if dense]
    calls += [(name, m, count, rows) for name, m, count, rows, _ in expert_shapes(model, batch)]
    return ([(name, m, m.out_features, m.in_features, count, linear_bytes(m), rows) for name, m, count, rows in calls]
            + [("lm_head", head, *head_shape, 1, head_bytes(model)[0], batch)])


class HeadCall:
    """The LM head as the engine's runner calls it: `compute_logits`, on CPU into one reused logits
    buffer (`LogitsBuffer`); `kernel` is the head's own callable, for `peaks.linear_path`."""

    def __init__(self, model: Any) -> None:
        self.model, self.kernel = model, model.lm_head_fn
        self.logits = LogitsBuffer(model.logits_out_width if model_device(model).type == "cpu" else None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden, self.logits.take(hidden.shape[0]))


@torch.inference_mode()
def measure_matmuls(model: Any, batch: int, *, repeats: int = 10, warmup: int = 3, seed: int = 0) -> dict[str, Any]:
    """GFLOP/s (and weight GB/s) of the model's linear layers at M = batch rows, and the linear-only tok/s
    ceiling."""
    g = torch.Generator().manual_seed(seed)
    device = model_device(model)
    shapes = []
    step_flops = step_s = params = 0.0
    for name, fn, out_f, in_f, count, nbytes, rows in linear_layers(model, batch):
        x = torch.randn(rows, in_f, generator=g).to(device=device, dtype=model.dtype)
        t = _time_call(lambda x=x, fn=fn: fn(x), device, repeats, warmup)
        flops = 2.0 * rows * in_f * out_f
        shapes.append({"name": name, "out_features": out_f, "in_features": in_f, "count": count, "rows": rows,
                       "time_s": t, "gflops": flops / t / 1e9, "weight_bytes": nbytes, "gb_per_s": nbytes / t / 1e9})
        if device.type == "cpu":
            shapes[-1]["path"], shapes[-1]["peak_kind"] = linear_path(fn, rows, model.dtype)
        step_flops += flops * count
        step_s += t * count
        params += in_f * out_f * count * rows / batch  # active parameters per token
    peaks = measure_peaks({s["peak_kind"] for s in shapes}) if device.type == "cpu" else {}
    for s in shapes:
        s["peak_gops"] = peak = peaks.get(s.get("peak_kind"))
        s["fraction_of_peak"] = s["gflops"] / peak if peak else None
    return {"m": batch, "shapes": shapes, "params_per_token": int(params), "flops_per_token": int(2 * params),
            "time_per_step_s": step_s, "gflops": step_flops / step_s / 1e9, "tok_per_s": batch / step_s,
            "peaks_gops": peaks, "peak_threads": torch.get_num_threads()}


# -- 2. dense ceiling ----------------------------------------------------------------------------------
@dataclass
class DenseDecodeMetadata:
    """All a dense decode step needs: every sequence's new token goes to cache position `position`."""

    position: int


class DenseDecodeAttention(AttentionBackend):
    """Decode attention over contiguous K/V: the floor that any paged implementation is measured against.

    `kv_cache` (one per layer, as the model passes it) is `[2, batch, kv_heads, max_len, head_dim]`;
    row b of the batch is sequence b. The new K/V is written at `meta.position` and each query
    attends to positions `0 .. meta.position` of its own sequence with one SDPA call, no gather.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: DenseDecodeMetadata, scale: float,  # type: ignore[override]
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [B, H, D]; k, v: [B, Hkv, D]. Returns [B, H, D]."""
        pos = meta.position
        if q.shape[0] != kv_cache.shape[1] or pos >= kv_cache.shape[3]:
            raise ValueError(f"dense decode: {q.shape[0]} queries at position {pos} do not fit a cache of "
                             f"{kv_cache.shape[1]} sequences x {kv_cache.shape[3]} positions")
        kv_cache[0, :, :, pos] = k
        kv_cache[1, :, :, pos] = v
        keys, values = (kv_cache[0], kv_cache[1]) if pos + 1 == kv_cache.shape[3] else \
            (kv_cache[0, :, :, :pos + 1], kv_cache[1, :, :, :pos + 1])
        return attend(q.unsqueeze(2), keys, values, None, False, scale, softcap, sinks).squeeze(2)


def dense_kv_caches(model: Any, batch: int, max_len: int, *, seed: int = 0) -> list[torch.Tensor]:
    """One `[2, batch, kv_heads, max_len, head_dim]` tensor per layer, filled with random values."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, batch, model.num_kv_heads, max_len, model.head_dim)
    return [torch.randn(shape, generator=g).to(device=model_device(model), dtype=model.dtype)
            for _ in range(model.num_layers)]


@torch.inference_mode()
def dense_decode_step(model: Any, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], position: int,
                      attention: DenseDecodeAttention | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of every sequence through the model's own forward: (fp32 logits, argmax ids)."""
    positions = torch.full_like(input_ids, position)
    metas = [DenseDecodeMetadata(position)] * model.num_layers
    hidden = model(input_ids, positions, kv_caches, metas, attention or DenseDecodeAttention())
    logits = model.compute_logits(hidden)
    return logits, logits.argmax(dim=-1)


class DenseBench:
    """The dense ceiling's inputs, allocated once; `once()` times one decode step (forward, LM head + argmax)."""

    def __init__(self, model: Any, batch: int, context: int, *, seed: int = 0) -> None:
        self.model, self.batch, self.context = model, batch, context
        self.device = model_device(model)
        self.kv = dense_kv_caches(model, batch, context + 1, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.ids = torch.randint(0, model.config.vocab_size, (batch,), generator=g).to(self.device)
        self.positions = torch.full_like(self.ids, context)
        self.metas, self.attention = [DenseDecodeMetadata(context)] * model.num_layers, DenseDecodeAttention()
        self.forward_s: list[float] = []
        self.head_s: list[float] = []

    @torch.inference_mode()
    def once(self, record: bool = True) -> None:
        sync(self.device)
        t0 = time.perf_counter()
        hidden = self.model(self.ids, self.positions, self.kv, self.metas, self.attention)
        sync(self.device)
        t1 = time.perf_counter()
        self.model.compute_logits(hidden).argmax(dim=-1).tolist()
        t2 = time.perf_counter()
        if record:
            self.forward_s.append(t1 - t0)
            self.head_s.append(t2 - t1)

    def summary(self, interleaved: bool = False) -> dict[str, Any]:
        steps = [f + h for f, h in zip(self.forward_s, self.head_s)]
        step = median(steps)
        return {"batch": self.batch, "context": self.context, "repeats": len(steps), "interleaved": interleaved,
                "step_s": step, "forward_s": median(self.forward_s), "lm_head_argmax_s": median(self.head_s),
                "tok_per_s": self.batch / step, "step_samples_s": steps}


def measure_dense(model: Any, batch: int, context: int, *, repeats: int = 10, warmup: int = 3,
                  seed: int = 0) -> dict[str, Any]:
    """Median time of one dense decode step (forward, then LM head + argmax) at `batch` x `context`."""
    bench = DenseBench(model, batch, context, seed=seed)
    for _ in range(max(warmup, 1)):
        bench.once(record=False)
    for _ in range(repeats):
        bench.once()
    return bench.summary()
