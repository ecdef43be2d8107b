"""Multi-LoRA batches against the same batch without adapters, on one engine.

`streams` random prompts generate `tokens` tokens each, all in one `generate`; in the "lora" run stream i runs
with adapter i mod (adapters + 1), the last share on the base model, in the "base" run every stream runs on
the base model. Both runs use the same `LLM` (LoRA on, `max_loras` = adapters), alternated repeat by repeat,
so the ratio is what the adapters' deltas cost (on CUDA also the eager path they take: no CUDA graph).
The adapters are random PEFT files of the asked rank on all seven projections of every layer, written to
a temporary directory (B not zero, so the deltas are real work).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def write_random_adapter(path: Path, config: Any, rank: int, seed: int) -> None:
    """A PEFT adapter directory for a Llama-layout model: q/k/v/o and gate/up/down of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {"self_attn.q_proj": (hidden, config.num_attention_heads * head_dim),
              "self_attn.k_proj": (hidden, config.num_key_value_heads * head_dim),
              "self_attn.v_proj": (hidden, config.num_key_value_heads * head_dim),
              "self_attn.o_proj": (config.num_attention_heads * head_dim, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (n_in, n_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [n.split(".")[1] for n in shapes]}))


def run_lora(model: str | None, *, adapters: int, rank: int, streams: int, prompt_tokens: int, tokens: int,
             repeats: int, dtype: str = "auto", quantization: str | None = None) -> dict[str, Any]:
    """Output tok/s of the batch with adapters and without, per repeat (alternated)."""
    from .. import LLM, ContinuousBatchingConfig, LoRARequest, SamplingParams
    from .modes import resolved_mode
    from .throughput import environment

    config = ContinuousBatchingConfig(max_requests_per_batch=max(streams, 1), allow_block_sharing=False)
    kwargs: dict[str, Any] = {"quantization": quantization} if quantization else {}
    llm = LLM(model, dtype=dtype, config=config, enable_lora=True, max_loras=adapters, max_lora_rank=rank,
              **kwargs)
    with tempfile.TemporaryDirectory(prefix="conveyor-lora-") as tmp:
        requests = []
        for i in range(adapters):
            write_random_adapter(Path(tmp) / f"a{i}", llm.model_config, rank, seed=i)
            requests.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(8, llm.vocab_size, (prompt_tokens,), generator=g).tolist() for _ in range(streams)]
        mixed = [requests[i % (adapters + 1)] if i % (adapters + 1) < adapters else None for i in range(streams)]
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        runs = {"base": [None] * streams, "lora": mixed}
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                     lora_request=mixed[:4])  # warm-up: kernels, buffers, the adapters into their slots
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, lora in runs.items():
                started = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
                rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started))
    stats = llm.stats()
    report = {"model": str(llm.model_path), "mode": resolved_mode(llm), "environment": environment(),
              "adapters": adapters, "rank": rank, "streams": streams, "prompt_tokens": prompt_tokens,
              "tokens": tokens, "repeats": repeats, "blocks_back": stats.free_blocks == stats.total_blocks,
              "systems": {name: {"tok_per_s": v, "median_tok_per_s": statistics.median(v)}
                          for name, v in rates.items()}}
    llm.shutdown()
    return report


def format_report(report: dict[str, Any]) -> str:
    from .modes import describe_mode

    base = report["systems"]["base"]["median_tok_per_s"]
    lines = [f"Multi-LoRA: {Path(report['model']).name}, {report['streams']} streams ({report['prompt_tokens']} "
             f"prompt tokens, {report['tokens']} generated each) over {report['adapters']} adapters of rank "
             f"{report['rank']} and the base, against all on the base; {report['repeats']} repeats alternated; "
             f"{describe_mode(report['mode'], report['environment'])}, {report['environment']['torch_threads']} threads",
             f"{'run':<8}{'tok/s':>9}{'min-max':>18}{'base/run':>10}"]
    for name, s in report["systems"].items():
        values = s["tok_per_s"]
        lines.append(f"{name:<8}{s['median_tok_per_s']:>9.1f}{f'{min(values):.1f}-{max(values):.1f}':>18}"
                     f"{base / s['median_tok_per_s']:>9.2f}x")
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    from .modes import add_mode_arguments

    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: the built-in SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--adapters", type=int, default=4, help="random adapters (default 4), plus the base")
    parser.add_argument("--rank", type=int, default=16, help="their rank (default 16)")
    parser.add_argument("--streams", type=int, default=32, help="requests in the batch (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="random prompt tokens each (default 32)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each generates (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repeats per run (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    add_mode_arguments(parser)


def run_from_args(args: Any) -> int:
    for flag, value in (("--adapters", args.adapters), ("--streams", args.streams), ("--tokens", args.tokens),
                        ("--repeats", args.repeats), ("--prompt-tokens", args.prompt_tokens)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        report = run_lora(args.model, adapters=args.adapters, rank=args.rank, streams=args.streams,
                          prompt_tokens=args.prompt_tokens, tokens=args.tokens, repeats=args.repeats,
                          dtype=args.dtype, quantization=args.quantization)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    text = format_report(report)
    if args.out:  # the JSON report too
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        text += f"\n\nWrote {args.out}"
    print(text)
    return 0
