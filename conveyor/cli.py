"""Command line: `conveyor generate "prompt" ...`, `conveyor serve ...`, `conveyor build-kernels` (and
`conveyor bench ...`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import fields

from .config import ATTENTION_BACKENDS, ContinuousBatchingConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model and `ContinuousBatchingConfig` options shared by every command that builds an engine."""
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: built-in "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--dtype", default="auto", help="auto (default: bf16 on CUDA and on CPUs with native bf16, "
                        "else fp32), float32 (the exact path), bfloat16 or float16")
    parser.add_argument("--quantization", default=None, choices=["none", "int8", "int4", "gguf"],
                        help="weight format (default: gguf for a quantized GGUF file unless --dtype float32, else none)")
    for f in fields(ContinuousBatchingConfig):
        if f.type in ("int", "int | None"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=None)
        elif f.type in ("float", "float | None"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=None)
        elif f.type == "bool | None":  # --use-cuda-graph / --no-use-cuda-graph; absent = auto
            parser.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--scheduler-type", choices=["fifo", "prefill_first"], default=None)
    parser.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default=None,
                        help="auto (default: Triton on CUDA, native kernels on CPU), torch, cpu or triton")
    parser.add_argument("--no-block-sharing", action="store_true", help="turn prefix caching off")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding, vLLM's JSON, e.g. "
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM's flag): --no-use-cuda-graph")


def config_from_args(args: argparse.Namespace) -> ContinuousBatchingConfig:
    values = {f.name: getattr(args, f.name) for f in fields(ContinuousBatchingConfig)
              if getattr(args, f.name, None) is not None}
    if args.no_block_sharing:
        values["allow_block_sharing"] = False
    if args.enforce_eager:
        values["use_cuda_graph"] = False
    return ContinuousBatchingConfig(**values)  # speculative_config: its JSON text, parsed and validated there


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
              config=config_from_args(args))
    if args.raw:
        outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                           use_tqdm=len(args.prompts) > 1)
    for prompt, out in zip(args.prompts, outputs):
        print(f"### {prompt}\n{out.text}\n[{out.num_output_tokens} tokens, finish_reason={out.finish_reason}]\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .manager import EngineDeadError
    from .server import ServerSettings, run_server

    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
              config=config_from_args(args))
    settings = ServerSettings(served_model_names=args.served_model_name, api_key=args.api_key,
                              max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout)
    try:
        run_server(llm, settings, host=args.host, port=args.port, log_level=args.log_level)
    except EngineDeadError as exc:  # exit non-zero so that a supervisor restarts the server
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_build_kernels(args: argparse.Namespace) -> int:
    """Build the native kernels now (scripts/setup.sh runs this) so that the first start does not wait for them."""
    from .kernels import build_all, native_kernels_enabled

    if not native_kernels_enabled():
        print("native kernels are off (CONVEYOR_NATIVE_KERNELS=0): nothing to build")
        return 0
    started = time.monotonic()
    results = build_all()
    for name, ok in results.items():
        print(f"{name}: {'ready' if ok else 'unavailable (the PyTorch code runs instead; see the warning above)'}")
    print(f"native kernels checked in {time.monotonic() - started:.0f} s")
    return 0 if all(results.values()) else 1


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                        "(default: $CONVEYOR_API_KEY, else no key)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) accepted in requests; the first is reported (default: the model's "
                        "file or directory name)")
    parser.add_argument("--max-queue", type=int, default=512,
                        help="most generations (prompts x n) accepted and unfinished; past it, 503 + Retry-After")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(parser)


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
    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `conveyor serve --help`)"))
    sub.add_parser("build-kernels", help="build the native CPU kernels now (once per environment; setup does it)")
    sub.add_parser("bench", help="benchmarks (see `conveyor bench --help`)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench.__main__ import main as bench_main
        return bench_main(argv[1:], prog="conveyor bench")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        commands = {"serve": cmd_serve, "generate": cmd_generate, "build-kernels": cmd_build_kernels}
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
