"""Command line: `conveyor generate "prompt" ...`, `conveyor serve ...`, `conveyor run-batch ...`,
`conveyor build-kernels` (and `conveyor bench ...`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from dataclasses import replace
from pathlib import Path

from .cli_args import add_engine_args, add_serve_args, llm_kwargs_from_args, model_from_args
from .errors import MissingDependencyError
from .models.hub import HUB_ID, resolve_model_path
from .scaleout import add_data_parallel_args, launch_module, serve_data_parallel
from .vllm_flags import ALREADY_SO, UNSUPPORTED, check_vllm_flags, expand_config_file

logger = logging.getLogger("conveyor")
SAMPLING_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
GENERATE_DEFAULTS = {"max_new_tokens": 128, "temperature": 0.0}  # where the generation config gives none


def looks_like_model(arg: str) -> bool:
    """Whether `conveyor generate`'s first argument names the model rather than a prompt: a model
    directory, a .gguf file, or a Hub id (org/name[:QUANT])."""
    path = Path(arg).expanduser()
    try:
        if (path / "config.json").is_file() or (path.is_file() and path.suffix.lower() == ".gguf"):
            return True
    except OSError:  # a prompt too long to be a path
        return False
    return HUB_ID.fullmatch(arg) is not None


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM

    if args.model is None and len(args.prompts) > 1 and looks_like_model(args.prompts[0]):
        args.model, args.prompts = args.prompts[0], args.prompts[1:]  # conveyor generate MODEL PROMPT...
    llm = LLM(**llm_kwargs_from_args(args))
    values = {k: v for k, v in GENERATE_DEFAULTS.items() if k not in llm.generation_defaults.values}
    values |= {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None}
    params = replace(llm.get_default_sampling_params(), **values, stop=args.stop or [], ignore_eos=args.ignore_eos)
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
    from .server import ServerSettings, check_address, run_server

    settings = ServerSettings.from_args(args)
    args.model = model_from_args(args)  # replicas get it as --model
    data_parallel = args.data_parallel_size != 1 or bool(args.data_parallel_address)
    if data_parallel:
        launch_module().plan(args)  # the settings first
    if args.model is not None and HUB_ID.fullmatch(args.model) and not Path(args.model).exists():
        resolve_model_path(args.model, revision=args.revision, download_dir=args.download_dir,
                           gguf_file=args.gguf_file, token=args.hf_token)  # one download, into the cache they read
    if args.uds and data_parallel:
        raise ValueError("--uds serves one engine: with replicas the router listens on --host and --port")
    if not args.uds:  # in use? Said now, not after the model's load (the front's, with replicas)
        check_address(args.host, args.port)
    if data_parallel:
        return serve_data_parallel(args)
    if args.threads is not None:
        plan_placement(1, args.threads)  # the same check as for replicas: no more threads than cores
        torch.set_num_threads(args.threads)
    llm = LLM(**llm_kwargs_from_args(args))
    try:
        run_server(llm, settings, host=args.host, port=args.port, log_level=args.log_level, uds=args.uds)
    except EngineDeadError as exc:  # exit non-zero so that a supervisor restarts the server
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    """vLLM's run-batch: the input file checked whole before the model loads, then run in this process."""
    import torch

    from .llm import LLM
    from .scaleout.placement import plan_placement
    from .server import ServerSettings
    from .server.run_batch import check_output, parse_batch, read_text, run_batch

    lines = parse_batch(read_text(args.input_file))
    check_output(args.output_file)
    settings = replace(ServerSettings.from_args(args), api_key=None)  # (no HTTP client to ask a key of)
    args.model = model_from_args(args)
    if args.threads is not None:
        plan_placement(1, args.threads)  # no more threads than cores, as for serve
        torch.set_num_threads(args.threads)
    llm = LLM(**llm_kwargs_from_args(args))
    outputs = run_batch(llm, settings, lines, args.output_file, args.output_tmp_dir,
                        (args.host, args.port) if args.enable_metrics else None)
    failed = sum(o["error"] is not None for o in outputs)
    print(f"{len(outputs)} requests, {failed} failed: {args.output_file}")
    return 0


def cmd_build_kernels(args: argparse.Namespace) -> int:
    """Build the native kernels now (scripts/setup.sh runs this) so that the first start does not wait for them."""
    from .kernels import build_all, native_kernels_enabled

    if not native_kernels_enabled():
        print("native kernels are off (CONVEYOR_NATIVE_KERNELS=0): nothing to build")
        return 0
    results = build_all(peaks=args.peaks)
    for name, seconds in results.items():
        print(f"{name}: " + (f"ready ({seconds:.0f} s)" if seconds is not None
                             else "unavailable (the PyTorch code runs instead; see the warning above)"))
    return 0 if all(s is not None for s in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="conveyor", description="Continuous-batching LLM inference engine")
    parser.add_argument("--version", action="version", version=importlib.metadata.version("conveyor"))
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts and print the results",
                         usage="conveyor generate [MODEL] PROMPT [PROMPT ...] [options]")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT",
                     help="one or more prompts (sent as one user turn each, through the model's chat template, "
                     "unless --raw); without --model, a first argument that is a model directory, .gguf file or "
                     "Hub id (org/name) is the model")
    sampling = gen.add_argument_group("sampling (default: the generation config's, else greedy, 128 tokens)")
    sampling.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    sampling.add_argument("--max-new-tokens", "--max-tokens", type=int, default=None,
                          help="tokens to generate at most (--max-tokens: vLLM's name)")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--repetition-penalty", type=float, default=None)
    sampling.add_argument("--stop", action="append", help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `conveyor serve --help`)",
                           usage="conveyor serve [MODEL] [options]",
                           description="OpenAI-compatible HTTP server: `conveyor serve [MODEL] [options]`, vLLM's "
                           "command line where Conveyor has the feature.",
                           epilog=f"vLLM flags not taken, each refused with what to use instead: "
                           f"{', '.join(UNSUPPORTED)}. Taken without effect (Conveyor always does what they ask): "
                           f"{', '.join(ALREADY_SO)}.")
    add_serve_args(serve)
    add_data_parallel_args(serve)
    batch = sub.add_parser("run-batch", help="run a file of OpenAI batch requests and write their results (vLLM's)",
                           usage="conveyor run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [options]",
                           description="vLLM's run-batch: each line of INPUT (OpenAI's batch format: custom_id, "
                           "method POST, url, body) through the server's route in this process, the results in "
                           "OUTPUT in input order; the server's options apply (--host/--port: the metrics endpoint).")
    batch.add_argument("-i", "--input-file", required=True, metavar="PATH_OR_URL",
                       help="the batch file: a local path or an http(s) URL")
    batch.add_argument("-o", "--output-file", required=True, metavar="PATH_OR_URL",
                       help="where the results go: a local path, or an http(s) URL they are PUT to")
    batch.add_argument("--output-tmp-dir", default=None, metavar="DIR",
                       help="write the results here first (kept if uploading them fails)")
    batch.add_argument("--enable-metrics", action="store_true",
                       help="serve Prometheus metrics on --host:--port while the batch runs")
    batch.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process "
                       "may use)")
    add_serve_args(batch)
    build = sub.add_parser("build-kernels", help="build the native CPU kernels now (once per compiler and CPU; setup "
                           "does it)")
    build.add_argument("--peaks", action="store_true", help="also the compute-peak loops the roofline diagnostics use")
    sub.add_parser("bench", help="benchmarks (see `conveyor bench --help`)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench.commands import main as bench_main
        return bench_main(argv[1:], prog="conveyor bench")
    try:
        known = {option for command in (gen, serve, batch) for action in command._actions
                 for option in action.option_strings}
        argv, notes = check_vllm_flags(expand_config_file(argv, known))
    except ValueError as exc:  # UnsupportedFlagError, or a --config file that cannot be read
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "log_format", "text") == "json":
        from .server.log_format import use_json_logs
        use_json_logs()
    for note in notes:
        logger.info("%s", note)
    try:
        commands = {"serve": cmd_serve, "generate": cmd_generate, "run-batch": cmd_run_batch,
                    "build-kernels": cmd_build_kernels}
        return commands[args.command](args)
    except (ValueError, OSError, MissingDependencyError) as exc:  # (OSError: files and URLs that cannot be read)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
