"""`python -m tools.roofline pair A B`: two models' decode steps, interleaved step by step in one process.

On a shared machine a step's time moves by tens of percent from minute to minute, so two `step`
runs minutes apart compare the machine as much as the models. Here both models are loaded, both get
`batch` random prompts of `context` tokens prefilled, and then their engine steps alternate (A, B, A,
B, ...): each pair sees the same machine. The report gives each model's median step and the median
of the per-pair ratios B / A, e.g. a mixture-of-experts model against a dense model with the same
active parameters (whose steps should stay within 1.5x of the dense model's at 64 decode rows).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from conveyor import LLM, SamplingParams
from conveyor.bench.modes import add_mode_arguments, resolved_mode
from conveyor.bench.throughput import environment

from .measure import sync
from .step import random_prompts, step_config


def prefilled(llm: Any, batch: int, context: int, new_tokens: int, seed: int) -> list[Any]:
    """`batch` requests of `context` random tokens, prefilled, each with its first token: decode-only next."""
    engine = llm.engine
    special = list(getattr(llm.get_tokenizer(), "all_special_ids", []) or []) + list(engine.eos_token_ids)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(f"pair-{i}", prompt, params)
                for i, prompt in enumerate(random_prompts(batch, context, engine.vocab_size, special, seed))]
    for r in requests:
        engine.add_request(r)
    for _ in range(batch * context + 1):
        if all(r.output_token_ids for r in requests):
            return requests
        engine.step()
    raise RuntimeError("prefill did not complete")


def run_pair(llm_a: Any, llm_b: Any, *, batch: int = 64, context: int = 150, steps: int = 20, warmup_steps: int = 2,
             seed: int = 0) -> dict[str, Any]:
    """Each model's decode step time, interleaved: medians and the median of the per-pair ratios B / A."""
    free = [llm.engine.allocator.num_free_blocks for llm in (llm_a, llm_b)]
    runs = [(llm, prefilled(llm, batch, context, warmup_steps + steps + 2, seed)) for llm in (llm_a, llm_b)]
    times: list[list[float]] = [[], []]
    try:
        for i in range(warmup_steps + steps):
            for j, (llm, _) in enumerate(runs):
                sync(llm.engine.device)
                started = time.perf_counter()
                llm.engine.step()
                sync(llm.engine.device)
                if i >= warmup_steps:
                    times[j].append(time.perf_counter() - started)
    finally:
        for llm, requests in runs:
            for r in requests:
                llm.engine.cancel_request(r.request_id)
    if [llm.engine.allocator.num_free_blocks for llm in (llm_a, llm_b)] != free:
        raise RuntimeError("the step-pair benchmark leaked KV blocks")
    return {"benchmark": "step-pair", "batch": batch, "context": context, "steps": steps,
            "models": [{"path": str(llm.model_path), **resolved_mode(llm), "step_s": statistics.median(t),
                        "step_samples_s": t} for (llm, _), t in zip(runs, times)],
            "b_over_a": statistics.median(b / a for a, b in zip(*times)), "environment": environment()}


def format_pair(report: dict[str, Any]) -> str:
    a, b = report["models"]
    env = report["environment"]
    lines = [f"Decode steps of {report['batch']} sequences (~{report['context']} tokens in cache), the two models "
             f"interleaved step by step, {report['steps']} each; torch {env['torch']} ({env['torch_threads']} threads)"]
    for name, m in (("A", a), ("B", b)):
        lines.append(f"  {name} {Path(m['path']).name} ({m['dtype']}, weights {m['quantization']}): median step "
                     f"{m['step_s'] * 1e3:.2f} ms")
    lines.append(f"  B / A: {report['b_over_a']:.2f}x (median of the per-pair ratios)")
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    parser.add_argument("model_a", help="the reference model (HF directory or .gguf), e.g. a dense model")
    parser.add_argument("model_b", help="the model set against it, e.g. a mixture-of-experts model")
    parser.add_argument("--batch", type=int, default=64, help="sequences decoded together (default 64)")
    parser.add_argument("--context", type=int, default=150, help="tokens in each sequence's cache (default 150)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each model (default 20)")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="auto")
    add_mode_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the report as JSON here")


def run_from_args(args: Any) -> int:
    for name in ("batch", "context", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = step_config(args.batch, args.context, args.warmup_steps + args.steps + 4)
    llms = [LLM(path, device=args.device, dtype=args.dtype, quantization=args.quantization, config=config)
            for path in (args.model_a, args.model_b)]
    print(f"Loaded {', '.join(Path(p).name for p in (args.model_a, args.model_b))}", file=sys.stderr)
    report = run_pair(*llms, batch=args.batch, context=args.context, steps=args.steps,
                      warmup_steps=args.warmup_steps, seed=args.seed)
    print(format_pair(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0
