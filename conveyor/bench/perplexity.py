"""`perplexity`: a model's perplexity on a text, the quality number that compares dtypes and quantizations.

The text is tokenized once (no special tokens added) and scored in windows of `window` tokens: each
window is one prompt with `prompt_logprobs=0` and `max_new_tokens=1`, all of them in one
`LLM.generate` call (only that call is timed, after a small warm-up). Window k starts at token
k x stride; with a stride smaller than the window (sliding-window perplexity, as in transformers'
guide) only the tokens no earlier window scored count, each with the context its window gives it.
A window's first token has no context inside it and is never scored (with stride = window, one
token per window goes unscored). Perplexity = exp(mean negative log-likelihood of the scored tokens).
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from .progress import add_progress_argument, progress_wanted
from .throughput import environment

WARMUP_TOKENS = 32


def plan_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """`(start, end, first_scored)` of every window: tokens `[start, end)` are its prompt, and tokens
    `[first_scored, end)` are those it scores (none scored twice; token 0 never)."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"window must be >= 2 and stride in [1, window], got window {window}, stride {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s): perplexity needs at least 2")
    spans, scored_to = [], 0
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        spans.append((start, end, max(scored_to, start + 1)))
        scored_to = end
        if end == num_tokens:
            break
    return spans


def load_llm(model: str | None, *, device: str = "auto", dtype: str = "auto", quantization: str | None = None,
             config: Any = None) -> Any:
    """`LLM`, passing `quantization` only when one is asked for (older `LLM`s do not take it)."""
    from .. import LLM

    kwargs: dict[str, Any] = {}
    if quantization is not None:
        if "quantization" not in inspect.signature(LLM).parameters:
            raise ValueError("--quantization: this Conveyor's LLM takes no quantization= option")
        kwargs["quantization"] = quantization
    return LLM(model, device=device, dtype=dtype, config=config, **kwargs)


def run_perplexity(llm: Any, token_ids: list[int], *, window: int = 512, stride: int | None = None,
                   quantization: str | None = None, source: str | None = None,
                   progress: bool = True) -> dict[str, Any]:
    """Score `token_ids` (of the text `source`) in windows (see the module docstring); the report as a
    JSON-able dict. `quantization` is what was asked for, reported where `llm` does not say what it
    resolved to (None: LLM's default)."""
    import torch

    from .. import SamplingParams

    stride = window if stride is None else stride
    limit = llm.max_model_len - 1  # room for the one generated token
    if window > limit:
        raise ValueError(f"window {window} exceeds the model's context length minus one ({limit} tokens)")
    spans = plan_windows(len(token_ids), window, stride)
    prompts = [token_ids[start:end] for start, end, _ in spans]
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    llm.generate([prompts[0][:WARMUP_TOKENS]], params, use_tqdm=False)
    cuda = llm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(llm.device)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    if cuda:
        torch.cuda.synchronize(llm.device)
    wall = time.perf_counter() - started
    errors = [o.error or o.finish_reason for o in outputs if o.finish_reason in ("error", "abort")]
    nll, scored = 0.0, 0
    for (start, end, first), out in zip(spans, outputs):
        if out.prompt_logprobs is None or len(out.prompt_logprobs) != end - start:
            continue  # failed: counted in errors
        for i in range(first, end):
            nll -= out.prompt_logprobs[i - start][token_ids[i]]  # type: ignore[index]
        scored += end - first
    mean = nll / scored if scored else float("nan")
    return {
        "benchmark": "perplexity", "text": source,
        "perplexity": math.exp(mean) if scored else float("nan"), "mean_nll": mean, "scored_tokens": scored,
        "text_tokens": len(token_ids), "num_windows": len(spans), "window": window, "stride": stride,
        "wall_s": wall, "scored_tok_per_s": scored / max(wall, 1e-9),
        "prompt_tok_per_s": sum(len(p) for p in prompts) / max(wall, 1e-9),
        "model": {"path": str(llm.model_path), "device": str(llm.device),
                  "dtype": str(llm.dtype).removeprefix("torch."),
                  "quantization": getattr(llm, "quantization", quantization)},
        "environment": environment(),
        "num_errors": len(errors), "errors": errors[:10],
    }


def format_report(report: dict[str, Any]) -> str:
    m, env = report["model"], report["environment"]
    lines = [
        f"Perplexity {report['perplexity']:.4f} (mean NLL {report['mean_nll']:.5f}) over {report['scored_tokens']} "
        f"scored tokens of {report['text_tokens']}" + (f" in {report['text']}" if report["text"] else ""),
        f"  {report['num_windows']} windows of {report['window']} tokens, stride {report['stride']}",
        f"  {report['wall_s']:.2f} s: {report['scored_tok_per_s']:.1f} scored tok/s "
        f"({report['prompt_tok_per_s']:.1f} prompt tok/s)",
        f"Model {Path(m['path']).name} on {m['device']} ({m['dtype']}, quantization {m['quantization'] or 'default'}), "
        f"torch {env['torch']} ({env['torch_threads']} threads)",
    ]
    if report["num_errors"]:
        lines.append(f"{report['num_errors']} windows FAILED (not scored): {report['errors'][:3]}")
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------
def add_arguments(parser: Any) -> None:
    parser.add_argument("textfile", help="UTF-8 text to score")
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--dtype", default="auto", help="as LLM's dtype= (auto, float32, bfloat16, ...)")
    parser.add_argument("--quantization", default=None, help="as LLM's quantization= (default: LLM's own)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens between window starts (default: the window, no overlap); smaller = "
                             "sliding-window perplexity, every token scored with more context")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="per-pass token budget (default: ContinuousBatchingConfig's)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="auto (default), int8, fp8, fp8_e5m2: how the KV cache is stored")
    parser.add_argument("--attention-backend", default=None,
                        help="as ContinuousBatchingConfig's (fp8 on CPU needs torch)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="split the model over N ranks (docs/scale-out.md)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    add_progress_argument(parser)


def run_from_args(args: Any) -> int:
    try:
        text = Path(args.textfile).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"error: cannot read {args.textfile}: {exc}") from None
    if args.max_tokens is not None and args.max_tokens < 2:
        raise SystemExit(f"error: --max-tokens must be >= 2, got {args.max_tokens}")
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"error: --threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    from .. import ContinuousBatchingConfig

    overrides = {k: v for k, v in (("max_batch_tokens", args.max_batch_tokens), ("num_blocks", args.num_blocks),
                                   ("tensor_parallel_size", args.tensor_parallel_size),
                                   ("kv_cache_dtype", args.kv_cache_dtype),
                                   ("attention_backend", args.attention_backend)) if v is not None}
    started = time.perf_counter()
    try:
        llm = load_llm(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                       config=ContinuousBatchingConfig(**overrides))
        print(f"Loaded {llm.model_path.name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[:args.max_tokens]
        report = run_perplexity(llm, token_ids, window=args.window, stride=args.stride,
                                quantization=args.quantization, source=args.textfile, progress=progress_wanted(args.no_progress))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nWrote {args.out}")
    return 1 if report["num_errors"] else 0
