"""Command line: `conveyor generate "prompt" ...` (and `conveyor bench ...`)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from .config import ContinuousBatchingConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model and `ContinuousBatchingConfig` options shared by every command that builds an engine."""
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: built-in "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    for f in fields(ContinuousBatchingConfig):
        if f.type in ("int", "int | None"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=None)
        elif f.type in ("float", "float | None"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=None)
    parser.add_argument("--scheduler-type", choices=["fifo", "prefill_first"], default=None)
    parser.add_argument("--no-block-sharing", action="store_true", help="turn prefix caching off")


def config_from_args(args: argparse.Namespace) -> ContinuousBatchingConfig:
    values = {f.name: getattr(args, f.name) for f in fields(ContinuousBatchingConfig)
              if getattr(args, f.name, None) is not None}
    if args.no_block_sharing:
        values["allow_block_sharing"] = False
    return ContinuousBatchingConfig(**values)


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, config=config_from_args(args))
    if args.raw:
        outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                           use_tqdm=len(args.prompts) > 1)
    for prompt, out in zip(args.prompts, outputs):
        print(f"### {prompt}\n{out.text}\n[{out.num_output_tokens} tokens, finish_reason={out.finish_reason}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description="Continuous-batching LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("prompts", nargs="+", help="one or more prompts (sent as one user turn each, through the "
                     "model's chat template, unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    sub.add_parser("bench", help="benchmarks (see `conveyor bench --help`)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench.__main__ import main as bench_main
        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return cmd_generate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
