"""Command line: `conveyor generate "prompt" ...`, `conveyor serve ...`, `conveyor build-kernels` (and
`conveyor bench ...`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from .cli_args import add_engine_args, add_serve_args, config_from_args
from .scaleout import add_data_parallel_args, serve_data_parallel


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
    import torch

    from .llm import LLM
    from .manager import EngineDeadError
    from .scaleout.placement import plan_placement
    from .server import ServerSettings, run_server

    settings = ServerSettings.from_args(args)
    if args.data_parallel_size != 1 or args.data_parallel_address:
        return serve_data_parallel(args)
    if args.threads is not None:
        plan_placement(1, args.threads)  # the same check as for replicas: no more threads than cores
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
              config=config_from_args(args))
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
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `conveyor serve --help`)")
    add_serve_args(serve)
    add_data_parallel_args(serve)
    sub.add_parser("build-kernels", help="build the native CPU kernels now (once per environment; setup does it)")
    sub.add_parser("bench", help="benchmarks (see `conveyor bench --help`)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench.commands import main as bench_main
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
