"""The `ceiling` and `step` reports (tools/roofline/__init__.py says what is measured) and their arguments."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from conveyor import LLM, ContinuousBatchingConfig
from conveyor.bench.modes import add_mode_arguments, describe_mode, resolved_mode
from conveyor.bench.throughput import environment

from conveyor.bench.bandwidth import MIN_PROBE_BYTES, format_streaming, read_bandwidth, streaming_report, weight_bytes
from .measure import DenseBench, measure_dense, measure_matmuls, median, model_device
from .step import measure_step, step_config

# What a decode step at 64 running sequences of ~150 tokens should reach: at most 1.25x the dense
# ceiling's time, under 10% of it outside the model forward.
TARGET_STEP_OVER_DENSE = 1.25
TARGET_OUTSIDE_FORWARD = 0.10
TARGET_STREAMING = 0.60  # the one-row step: its weights streamed at >= 60% of the measured read bandwidth
ROOFLINE_POOL_BLOCKS = 8  # `ceiling` runs the model alone; the engine's pool only has to exist


def load_model(model: str | None = None, *, device: str = "auto", dtype: str = "auto",
               quantization: str | None = None) -> Any:
    """The model as `LLM` builds it (same dtype and weight format resolution), with a token-sized KV pool:
    the roofline runs the model alone."""
    return LLM(model, device=device, dtype=dtype, quantization=quantization,
               config=ContinuousBatchingConfig(num_blocks=ROOFLINE_POOL_BLOCKS))


def _header(benchmark: str, llm: Any, batch: int, context: int) -> dict[str, Any]:
    model, c = llm.engine.model, llm.engine.model.config
    return {"benchmark": benchmark, "batch": batch, "context": context,
            "model": {"path": str(llm.model_path), "device": str(model_device(model)), **resolved_mode(llm),
                      "num_layers": model.num_layers, "hidden_size": c.hidden_size,
                      "intermediate_size": c.intermediate_size, "num_heads": c.num_attention_heads,
                      "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim, "vocab_size": c.vocab_size},
            "environment": environment()}


def run_roofline(llm: Any, *, batch: int = 64, context: int = 150, repeats: int = 10, warmup: int = 3,
                 seed: int = 0) -> dict[str, Any]:
    """Matmul rates and the dense-decode ceiling of `llm`'s model; a JSON-able report."""
    model = llm.engine.model
    report = _header("roofline", llm, batch, context)
    report["matmul"] = measure_matmuls(model, batch, repeats=repeats, warmup=warmup, seed=seed)
    report["dense"] = measure_dense(model, batch, context, repeats=repeats, warmup=warmup, seed=seed)
    report["ratios"] = {"dense_over_linear_ceiling": report["dense"]["tok_per_s"] / report["matmul"]["tok_per_s"]}
    return report


def run_step(llm: Any, *, batch: int = 64, context: int = 150, steps: int = 10, warmup_steps: int = 2,
             repeats: int = 10, warmup: int = 3, seed: int = 0,
             bandwidth_buffer_bytes: int | None = None) -> dict[str, Any]:
    """Matmul rates, then Conveyor's real decode step, split, interleaved step by step with the dense
    ceiling of the same model (so their ratio is measured under the same conditions); then the step's
    weight-streaming rate against the machine's read bandwidth, probed right after."""
    model = llm.engine.model
    report = _header("step", llm, batch, context)
    report["conveyor_config"] = dict(vars(llm.engine.config))
    report["matmul"] = measure_matmuls(model, batch, repeats=repeats, warmup=warmup, seed=seed)
    dense = DenseBench(model, batch, context, seed=seed)
    for _ in range(max(warmup, 1)):
        dense.once(record=False)
    report["step"] = measure_step(llm, batch, context, steps=steps, warmup_steps=warmup_steps, seed=seed, dense=dense)
    report["dense"] = dense.summary(interleaved=True)
    del dense
    step, dense_r = report["step"], report["dense"]
    report["ratios"] = {"dense_over_linear_ceiling": dense_r["tok_per_s"] / report["matmul"]["tok_per_s"],
                        "step_over_dense": step["step_s"] / dense_r["step_s"],
                        "forward_over_dense_forward": step["forward_s"] / dense_r["forward_s"],
                        "step_over_dense_per_step": median([a / b for a, b in zip(step["step_samples_s"],
                                                                                   dense_r["step_samples_s"])])}
    report["streaming"] = streaming_report(weight_bytes(model), step["forward_lm_head_s"],
                                           read_bandwidth(bandwidth_buffer_bytes, device=model_device(model)))
    report["targets"] = {
        "streaming_fraction_min": TARGET_STREAMING,
        "streaming_met": report["streaming"]["fraction_of_bandwidth"] >= TARGET_STREAMING,
        "step_over_dense_max": TARGET_STEP_OVER_DENSE,
        "step_over_dense_met": report["ratios"]["step_over_dense"] <= TARGET_STEP_OVER_DENSE,
        "outside_forward_fraction_max": TARGET_OUTSIDE_FORWARD,
        "outside_forward_met": step["outside_forward_fraction"] < TARGET_OUTSIDE_FORWARD}
    return report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _of_peak(shape: dict[str, Any]) -> str:
    """A shape's GFLOP/s as a share of its path's measured peak, with the path's name."""
    if shape.get("fraction_of_peak") is None:
        return "n/a" if shape.get("peak_kind") else ""
    return f"{shape['fraction_of_peak']:.0%} {shape['peak_kind']}"


def format_report(report: dict[str, Any]) -> str:
    m, env, mm, d = report["model"], report["environment"], report["matmul"], report["dense"]
    b = report["batch"]
    quantized = m["quantization"] != "none"
    lines = [f"Model {Path(m['path']).name} on {m['device']} ({describe_mode(m, env)}): {m['num_layers']} layers, "
             f"hidden {m['hidden_size']}, {m['num_heads']}/{m['num_kv_heads']} heads; torch {env['torch']} "
             f"({env['torch_threads']} threads)",
             f"Batch {b} sequences, context {report['context']} tokens", "",
             f"Linear layers at M = {b} rows (the model's own, median per call):"]
    rows = [(s["name"], f"{s['out_features']} x {s['in_features']}", f"x{s['count']}", _ms(s["time_s"]),
             f"{s['gflops']:.1f}", f"{s['gb_per_s']:.1f}", _of_peak(s), s.get("path", "")) for s in mm["shapes"]]
    rows.append(("all, per step", f"{mm['params_per_token'] / 1e6:.1f}M params", "", _ms(mm["time_per_step_s"]),
                 f"{mm['gflops']:.1f}", "", "", ""))
    header = ("shape", "out x in", "runs", "time", "GFLOP/s", "weight GB/s", "of peak", "path")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.ljust(widths[i]) if i in (0, len(r) - 1) else c.rjust(widths[i])  # noqa: E731
                                     for i, c in enumerate(r)).rstrip()
    lines += [fmt(header)] + [fmt(r) for r in rows]
    if mm.get("peaks_gops"):
        lines.append(f"  measured peaks on {mm['peak_threads']} threads (GOP/s, tools/roofline/peaks.py): " + ", ".join(
            f"{k} {'n/a' if v is None else f'{v:.1f}'}" for k, v in mm["peaks_gops"].items()))
    lines += [f"  linear-only ceiling: {mm['tok_per_s']:.1f} tok/s ({mm['flops_per_token'] / 1e6:.1f} MFLOP per token, "
              "LM head included)", "",
              f"Dense ceiling (same model{', the same quantized weights' if quantized else ''}: only the K/V are "
              f"dense, contiguous, one SDPA per layer, no paging or scheduling), median of "
              f"{d['repeats']}" + (", each run right after a timed Conveyor step:" if d.get("interleaved") else ":"),
              f"  step {_ms(d['step_s'])} = forward {_ms(d['forward_s'])} + LM head & argmax "
              f"{_ms(d['lm_head_argmax_s'])} -> {d['tok_per_s']:.1f} tok/s, "
              f"{report['ratios']['dense_over_linear_ceiling']:.0%} of the linear-only ceiling"]
    s = report.get("step")
    if s:
        r, t = report["ratios"], report["targets"]

        def part(label: str, key: str) -> str:
            return f"  {label:<36}{_ms(s[key]):>11}  {s[key] / s['step_s']:6.1%}"

        lines += ["", f"Conveyor decode step ({b} running sequences, {s['timed_context'][0]}-{s['timed_context'][1]} "
                  f"tokens in cache; median of {s['steps']} steps after {s['warmup_steps']} warm-up; "
                  f"prefill took {s['prefill_s']:.1f} s in {s['prefill_steps']} steps):",
                  part("step", "step_s"), part("model forward", "forward_s"), *_expert_lines(s, part),
                  part("LM head + sampling", "lm_head_sampling_s"),
                  (f"    (LM head fused with the greedy argmax {_ms(s['lm_head_s'])}: no logits, no sampler)"
                   if s.get("fused_head") else f"    (LM head {_ms(s['lm_head_s'])}, sampler {_ms(s['sampling_s'])})"),
                  part("input preparation", "prepare_s"),
                  part("rest (schedule, append, detokenize)", "rest_s"),
                  f"  -> {s['tok_per_s']:.1f} tok/s",
                  f"  outside the model forward: {s['outside_forward_fraction']:.1%} of the step (host work alone, "
                  f"without the LM head: {s['host_fraction']:.1%}); target < {t['outside_forward_fraction_max']:.0%}: "
                  f"{'met' if t['outside_forward_met'] else 'NOT met'}",
                  f"  step / dense ceiling: {r['step_over_dense']:.2f}x (median of per-step pairs "
                  f"{r['step_over_dense_per_step']:.2f}x; forward / dense forward "
                  f"{r['forward_over_dense_forward']:.2f}x); "
                  f"target <= {t['step_over_dense_max']}x: "
                  f"{'met' if t['step_over_dense_met'] else 'NOT met'}", ""]
        lines += format_streaming(report["streaming"], t["streaming_fraction_min"])
    return "\n".join(lines)


def _expert_lines(s: dict[str, Any], part: Any) -> list[str]:
    """A mixture-of-experts model's sparse blocks in the step (inside the model forward) and its expert load."""
    load = s.get("expert_load")
    if not load or not load["rows_per_expert"]:
        return []
    r = load["rows_per_expert"]
    return [part("  of which mixture-of-experts blocks", "moe_s"),
            f"    expert load: {load['routed_rows_per_call']:.0f} routed rows per sparse layer (top-{load['top_k']} of "
            f"{load['experts']} experts); rows per expert per layer and step min {r['min']} / median "
            f"{r['median']:g} / max {r['max']}; {load['busy_experts_median']:g} experts busy (median of "
            f"{load['layer_calls']} layer calls)"]


# -- command line (tools/roofline/cli.py) -------------------------------------------------------
def add_arguments(parser: Any, *, step: bool = False) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--batch", type=int, default=64, help="sequences decoded together (default 64)")
    parser.add_argument("--context", type=int, default=150,
                        help="tokens already in each sequence's cache (default 150)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's); on a shared machine use fewer than the cores")
    parser.add_argument("--device", default="auto")
    add_mode_arguments(parser)
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions of each matmul and dense step")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    parser.add_argument("--seed", type=int, default=0)
    if step:
        parser.add_argument("--steps", type=int, default=10, help="timed engine steps (default 10)")
        parser.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps first (default 2)")
        parser.add_argument("--page-size", type=int, default=16)
        parser.add_argument("--max-batch-tokens", type=int, default=None,
                            help="engine token budget (default: batch x context, so every prompt prefills in one "
                                 "pass and all sequences decode at the same length)")
        parser.add_argument("--bandwidth-buffer-mib", type=float, default=None,
                            help="buffer of the read-bandwidth probe (default: twice the last-level cache, at least "
                                 f"{MIN_PROBE_BYTES >> 20} MiB)")
    parser.add_argument("--out", default=None, help="write the full report (all figures) as JSON here")


def run_from_args(args: Any) -> int:
    step = getattr(args, "steps", None) is not None
    for name in ("batch", "context", "repeats") + (("steps",) if step else ()):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"error: --threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if step:
        config = step_config(args.batch, args.context, args.warmup_steps + args.steps + 4, page_size=args.page_size,
                             max_batch_tokens=args.max_batch_tokens)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization, config=config)
        print(f"Loaded {llm.model_path.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        buffer = None if args.bandwidth_buffer_mib is None else int(args.bandwidth_buffer_mib * 2**20)
        report = run_step(llm, batch=args.batch, context=args.context, steps=args.steps,
                          warmup_steps=args.warmup_steps, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                          bandwidth_buffer_bytes=buffer)
    else:
        llm = load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
        print(f"Loaded {llm.model_path.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        report = run_roofline(llm, batch=args.batch, context=args.context, repeats=args.repeats,
                              warmup=args.warmup, seed=args.seed)
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    return 0
