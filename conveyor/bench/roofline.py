"""How close is a decode step to what the hardware and the model allow? `roofline` and `step`.

Four measurements, all on the same model object (a `CausalLM`, as `LLM` builds it for the
`--dtype` and `--quantization` asked for):

1. Matmul rate: the model's own linear layers (as its forward runs them: oneDNN-packed on CPU
   fp32, the quantized kernels for quantized weights) on each distinct weight shape (fused
   qkv_proj, o_proj, gate_up_proj, down_proj of one layer, and the LM head) at M = batch rows (a
   mixture-of-experts model's experts at their share, batch x top-k / experts: `expert_load.py`).
   FLOPs per token are 2 x the parameters touched per token (every layer's linears plus the LM
   head), so the per-shape times, weighted by how often each shape runs, give the tok/s ceiling of
   the linear layers alone; each shape's weight bytes over its time give its streaming rate. On
   CPU each shape also names the instruction path it took, and its GFLOP/s is set against that
   path's peak measured on the same threads (`peaks.py`).
2. Dense ceiling: ONE decode step of `batch` sequences of `context` cached tokens through the
   model's own `forward` (its own weights, quantized or not) with `DenseDecodeAttention`:
   contiguous per-layer K/V `[batch, kv_heads, context + 1, head_dim]`, the new token's K/V
   written at position `context`, one `scaled_dot_product_attention` per layer with no gather, no
   mask, no paging, no scheduling; then `compute_logits` and an argmax. Everything Conveyor adds
   on top of this is overhead.
3. Conveyor's real step (`step` only): `batch` requests with random `context`-token prompts are
   prefilled, then `Engine.step()` is timed and split into model forward, LM head + sampling,
   input preparation (`ModelRunner.prepare`) and the rest (scheduling, token append,
   detokenization), by wrapping those methods on the instances for the duration of the timing.
4. Weight streaming (`step` only, see `streaming.py`): the weight bytes a step reads over its
   model forward + LM head time, against the machine's read bandwidth probed right after.

`roofline` reports 1 and 2; `step` reports all four and the ratio of Conveyor's step to the
dense ceiling measured in the same run: there each dense step runs right after a timed engine
step, so both see the same machine (on a shared CPU, contention comes and goes within minutes).
Times are medians after warm-up. The reports and the command line are in `roofline_report.py`.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.step_buffers import LogitsBuffer
from ..layers.attention import AttentionBackend, attend
from ..layers.quantization.linear import QuantMatmul
from .bandwidth import head_bytes, linear_bytes
from .expert_load import ExpertLoad, expert_shapes, sparse_blocks
from .peaks import linear_path, measure_peaks

MIN_SAMPLE_S = 2e-3  # matmul timing: repeat a call until one sample lasts at least this long


# -- timing helpers ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    """The median; NaN for no values (a report still prints)."""
    return statistics.median(values) if values else float("nan")


def _time_call(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds per call of `fn`; short calls are looped so one sample lasts >= MIN_SAMPLE_S."""
    for _ in range(max(warmup, 1)):
        fn()
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - started, 1e-7)
    inner = max(1, min(1000, math.ceil(MIN_SAMPLE_S / once)))
    samples = []
    for _ in range(max(repeats, 1)):
        _sync(device)
        started = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
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
        _sync(self.device)
        t0 = time.perf_counter()
        hidden = self.model(self.ids, self.positions, self.kv, self.metas, self.attention)
        _sync(self.device)
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


# -- 3. Conveyor's real decode step -----------------------------------------------------------------
class _Probe:
    """Wraps methods on instances (not classes) to accumulate their time within one engine step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.time: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        had = attr in vars(obj)
        previous = vars(obj).get(attr)
        original = getattr(obj, attr)
        self.time[name], self.calls[name] = 0.0, 0

        def timed(*args: Any, **kwargs: Any) -> Any:
            _sync(self.device)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync(self.device)
                self.time[name] += time.perf_counter() - started
                self.calls[name] += 1

        object.__setattr__(obj, attr, timed)

        def undo() -> None:
            if had:
                object.__setattr__(obj, attr, previous)
            else:
                object.__delattr__(obj, attr)

        self._undo.append(undo)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


@contextlib.contextmanager
def instrument(engine: Any) -> Iterator[_Probe]:
    """Time `runner.execute`, `runner.prepare`, `model.forward`, `model.compute_logits` and `runner.sampler.sample`,
    `model.greedy_tokens` (the LM head fused with greedy sampling, which stands for both when it runs), and a
    mixture-of-experts model's sparse blocks (all layers' under "moe")."""
    runner = engine.runner
    probe = _Probe(engine.device)
    try:
        probe.wrap(runner, "execute", "execute")
        probe.wrap(runner, "prepare", "prepare")
        probe.wrap(runner.model, "forward", "forward")
        probe.wrap(runner.model, "compute_logits", "lm_head")
        probe.wrap(runner.model, "greedy_tokens", "fused_head")
        probe.wrap(runner.sampler, "sample", "sampling")
        for block in sparse_blocks(runner.model):  # mixture-of-experts blocks, summed over the layers
            probe.wrap(block, "forward", "moe")
        yield probe
    finally:
        probe.restore()


def random_prompts(batch: int, length: int, vocab_size: int, exclude: list[int], seed: int = 0) -> list[list[int]]:
    """Random token ids, special tokens left out."""
    excluded = set(exclude)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in excluded])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(0, len(allowed), (batch, length), generator=g)].tolist()


def step_config(batch: int, context: int, new_tokens: int, *, page_size: int = 16,
                max_batch_tokens: int | None = None) -> Any:
    """A config whose pool holds every request to its end; all prompts prefill in one pass by default
    (so every sequence has exactly `context` tokens when decoding starts)."""
    from .. import ContinuousBatchingConfig

    blocks = batch * -(-(context + new_tokens) // page_size)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=math.ceil(blocks / 0.8) + 4,
                                    max_requests_per_batch=max(64, batch),
                                    max_batch_tokens=max_batch_tokens or max(512, batch * context))


def measure_step(llm: Any, batch: int, context: int, *, steps: int = 10, warmup_steps: int = 2,
                 seed: int = 0, dense: DenseBench | None = None) -> dict[str, Any]:
    """Prefill `batch` random `context`-token prompts, then time `steps` decode steps (after `warmup_steps`).

    With `dense`, one dense-ceiling step runs (and is recorded) right after each engine step, so the
    two are measured interleaved, under the same conditions, rather than minutes apart.
    """
    from .. import SamplingParams
    from ..request import RequestState

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine already has requests; the step benchmark needs an idle engine")
    if batch > engine.config.max_requests_per_batch:
        raise ValueError(f"batch {batch} exceeds max_requests_per_batch={engine.config.max_requests_per_batch}")
    new_tokens = warmup_steps + steps + 4
    special = list(getattr(llm.get_tokenizer(), "all_special_ids", []) or []) + list(engine.eos_token_ids)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(f"roofline-step-{i}", prompt, params)
                for i, prompt in enumerate(random_prompts(batch, context, engine.vocab_size, special, seed))]
    free_before = engine.allocator.num_free_blocks
    device = engine.device
    try:
        for r in requests:
            engine.add_request(r)
        started = time.perf_counter()
        prefill_steps = 0
        while not all(r.state is RequestState.DECODING for r in requests):
            broken = [r for r in requests if r.is_finished]
            if broken or prefill_steps > batch * context:
                raise RuntimeError(f"prefill did not complete: {broken[0].request_id} ended "
                                   f"({broken[0].finish_reason}: {broken[0].error})" if broken else
                                   "prefill did not complete")
            engine.step()
            prefill_steps += 1
        _sync(device)
        prefill_s = time.perf_counter() - started
        start_context = sorted(r.num_tokens - 1 for r in requests)  # tokens in cache before the first decode

        rows: list[dict[str, float]] = []
        contexts: list[int] = []
        load = ExpertLoad(engine.runner.model)
        for i in range(warmup_steps + steps):
            in_cache = [r.num_tokens - 1 for r in requests]
            with instrument(engine) as probe, load if i >= warmup_steps else contextlib.nullcontext():
                _sync(device)
                t0 = time.perf_counter()
                stepped = engine.step()
                _sync(device)
                total = time.perf_counter() - t0
            if len(stepped) != batch or any(r.is_finished for r in requests):
                raise RuntimeError(f"decode step {i} advanced {len(stepped)} of {batch} requests")
            calls = probe.calls
            fused = calls.get("sampling", 0) == 0 and calls.get("fused_head", 0) == 1
            if (any(calls.get(k, 0) != 1 for k in ("execute", "prepare", "forward"))
                    or not fused and (calls.get("lm_head", 0) != 1 or calls.get("sampling", 0) != 1)):
                raise RuntimeError(f"the step timing hooks fired {calls} times (expected once each, or the fused "
                                   "head instead of the head and the sampler): ModelRunner or Engine changed shape; "
                                   "update conveyor/bench/roofline.py")
            if dense is not None:  # right after, so both see the same machine (threads, contention, caches)
                dense.once(record=i >= warmup_steps)
            if i < warmup_steps:
                continue
            t = dict(probe.time)
            head = t.get("lm_head", 0.0) + t.get("fused_head", 0.0)
            rows.append({"step_s": total, "forward_s": t["forward"], "prepare_s": t["prepare"],
                         "lm_head_sampling_s": t["execute"] - t["prepare"] - t["forward"],
                         "lm_head_s": head, "forward_lm_head_s": t["forward"] + head,
                         "sampling_s": t.get("sampling", 0.0), "fused_head": float(fused),
                         "rest_s": total - t["execute"], "outside_forward_s": total - t["forward"],
                         "moe_s": t.get("moe", 0.0)})
            contexts += [min(in_cache), max(in_cache)]
    finally:
        for r in requests:
            engine.cancel_request(r.request_id)
    if engine.allocator.num_free_blocks != free_before:
        raise RuntimeError("the step benchmark leaked KV blocks")
    medians = {key: median([row[key] for row in rows]) for key in rows[0]}
    return {"batch": batch, "context": context, "steps": steps, "warmup_steps": warmup_steps,
            "prefill_steps": prefill_steps, "prefill_s": prefill_s,
            "start_context": [start_context[0], start_context[-1]],
            "timed_context": [min(contexts), max(contexts)],
            **medians,
            "outside_forward_fraction": median([r["outside_forward_s"] / r["step_s"] for r in rows]),
            "host_fraction": median([(r["step_s"] - r["forward_s"] - r["lm_head_s"]) / r["step_s"] for r in rows]),
            "tok_per_s": batch / medians["step_s"],
            "step_samples_s": [r["step_s"] for r in rows],
            **({"moe_fraction": median([r["moe_s"] / r["step_s"] for r in rows]), "expert_load": load.summary()}
               if load.blocks else {})}
