"""Embedding throughput: `LLM(runner="pooling").embed` over many texts, optionally against vLLM's.

`num_texts` random token-id texts of `text_len` tokens (seeded) are embedded in one `embed` call after an
untimed one, `repeats` times, prefix caching off; the report gives prompt tokens per second (the median
run and the spread). With `compare=vllm` vLLM's offline `LLM(runner="pooling").embed` runs the same token
ids in its own interpreter (`vllm_compare.py`: the same model file or `--vllm-model`, dtype and threads;
prefix caching off; one untimed pass, then one timed), and the report adds its rate, the ratio, and how far apart the two
engines' embeddings are (the cosine similarity of each text's pair: both pool the last token's final
hidden state, normalized, by default).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..pooling_llm import cosine
from .modes import add_mode_arguments, describe_mode, resolved_mode
from .throughput import environment, vllm_options_from_args
from .vllm_compare import add_vllm_arguments, call_runner, vllm_dtype


def random_texts(num_texts: int, text_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Texts of random token ids (none of the first 100, where special tokens sit)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(text_len)] for _ in range(num_texts)]


def run_embed(llm: Any, texts: list[list[int]], *, repeats: int = 3) -> dict[str, Any]:
    """`repeats` timed `embed` calls over every text, after an untimed one (the KV pool's pages are touched
    on first use: vLLM's are at start-up); tok/s and the last run's embeddings."""
    llm.embed([{"prompt_token_ids": t} for t in texts], use_tqdm=False)
    tokens = sum(len(t) for t in texts)
    rates, outputs = [], []
    for _ in range(max(repeats, 1)):
        started = time.perf_counter()
        outputs = llm.embed([{"prompt_token_ids": t} for t in texts], use_tqdm=False)
        rates.append(tokens / (time.perf_counter() - started))
    return {"tokens": tokens, "tok_per_s": statistics.median(rates), "runs_tok_per_s": rates,
            "embeddings": [o.outputs.embedding for o in outputs]}


def run_vllm_embed(options: Any, *, model: str, dtype: Any, texts: list[list[int]]) -> dict[str, Any]:
    """vLLM's pooling `LLM.embed` over the same texts in its own interpreter: tok/s and embeddings."""
    request = {"protocol": 1, "task": "embed", "model": options.model or model, "tokenizer": options.tokenizer,
               "dtype": vllm_dtype(dtype), "prompts": texts,
               # as ours: the untimed pass would otherwise fill its prefix cache with the timed pass's texts
               "llm_kwargs": {"enable_prefix_caching": False, **options.llm_kwargs}}
    result = call_runner(options, request)
    return {"tokens": sum(len(t) for t in texts), "tok_per_s": sum(len(t) for t in texts) / result["wall_s"],
            "embeddings": result["embeddings"], "vllm_version": result.get("vllm_version"),
            "model": request["model"], "dtype": result.get("dtype"), "env": result.get("env", {})}


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the built-in model)")
    add_mode_arguments(parser)
    parser.add_argument("--num-texts", type=int, default=256, help="texts embedded per run (default 256)")
    parser.add_argument("--text-len", type=int, default=200, help="tokens per text (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random texts")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of Conveyor (default 3; the median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (and vLLM's cores)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="Conveyor's per-pass token budget (default: a pooling model's, 2048)")
    parser.add_argument("--compare", choices=["vllm"], default=None, help="also run vLLM's pooling LLM.embed")
    add_vllm_arguments(parser)
    parser.add_argument("--out", default=None, help="write the report (without the embeddings) as JSON here")


def format_report(report: dict[str, Any]) -> str:
    ours = report["conveyor"]
    lines = [f"Embeddings: {report['num_texts']} texts of {report['text_len']} tokens, {report['model']} "
             f"({describe_mode(report['mode'], report['environment'])}), {report['environment']['torch_threads']} "
             "threads",
             f"{'system':<10}{'tok/s':>10}{'min-max':>20}",
             f"{'conveyor':<10}{ours['tok_per_s']:>10.1f}{min(ours['runs_tok_per_s']):>10.1f}-"
             f"{max(ours['runs_tok_per_s']):<9.1f}"]
    if "vllm" in report:
        vl = report["vllm"]
        lines.append(f"{'vllm':<10}{vl['tok_per_s']:>10.1f}")
        lines.append(f"conveyor is {ours['tok_per_s'] / vl['tok_per_s']:.2f}x vLLM ({vl['vllm_version']}, "
                     f"{vl['dtype']}); embeddings' cosine similarity min {report['cosine']['min']:.5f}, "
                     f"mean {report['cosine']['mean']:.5f}")
    return "\n".join(lines)


def run_from_args(args: Any) -> int:
    for name in ("num_texts", "text_len", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.compare = [args.compare] if args.compare else []
    vllm = vllm_options_from_args(args)
    import torch

    from .. import LLM

    if args.threads is not None:
        torch.set_num_threads(max(args.threads, 1))
    # No prefix caching: every repeat embeds the same texts, and a cache hit would skip the work being timed.
    kwargs: dict[str, Any] = {"enable_prefix_caching": False}
    if args.quantization:
        kwargs["quantization"] = args.quantization
    if args.max_batch_tokens:
        kwargs["max_num_batched_tokens"] = args.max_batch_tokens
    try:
        llm = LLM(args.model, runner="pooling", dtype=args.dtype, **kwargs)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    texts = random_texts(args.num_texts, args.text_len, len(llm.get_tokenizer()), args.seed)
    report: dict[str, Any] = {"model": llm.model_path.name, "mode": resolved_mode(llm), "num_texts": args.num_texts,
                              "text_len": args.text_len, "environment": environment(),
                              "conveyor": run_embed(llm, texts, repeats=args.repeats)}
    if vllm is not None:
        report["vllm"] = run_vllm_embed(vllm, model=str(llm.model_path), dtype=llm.dtype, texts=texts)
        pairs = [cosine(a, b) for a, b in zip(report["conveyor"]["embeddings"], report["vllm"]["embeddings"])]
        report["cosine"] = {"min": min(pairs), "mean": statistics.fmean(pairs)}
    print(format_report(report))
    if args.out:
        slim = {k: ({kk: vv for kk, vv in v.items() if kk != "embeddings"} if isinstance(v, dict) else v)
                for k, v in report.items()}
        Path(args.out).write_text(json.dumps(slim, indent=1) + "\n")
        print(f"\nWrote {args.out}", file=sys.stderr)
    return 0
