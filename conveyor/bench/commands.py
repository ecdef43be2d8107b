"""`python -m conveyor.bench SUBCOMMAND ...` (and, once mounted, `conveyor bench ...`).

Subcommands: `throughput` (offline throughput, optionally against transformers or vLLM), `decode`
(decode at depth against the machine's read bandwidth), `serve` (online serving benchmark of any
OpenAI-compatible server, over HTTP), `perplexity` (a model's perplexity on a text, in windows,
through prompt logprobs), `embed` (embedding throughput, optionally against vLLM), `lora` (a batch over several LoRA adapters against the same batch on the base). The project CLI can mount the suite with
`add_subcommands(subparsers)` or simply call `main(argv)`. The checkout's diagnostics, QA harnesses
and simulations are in tools/ (not installed).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..errors import MissingDependencyError, require

# The optional packages a benchmark needs, checked before it starts (a server launched, a model loaded), with
# the extra of pyproject.toml that brings each: HTTP clients need httpx.
REQUIRES: dict[str, tuple[tuple[str, str], ...]] = {"serve": (("httpx", "bench"),)}


def build_parser(prog: str = "python -m conveyor.bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Conveyor benchmark suite")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    add_subcommands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    return parser


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register every benchmark subcommand; each sets `func(args) -> exit code`."""
    from . import decode, embed, lora, perplexity, serve, throughput

    commands = [
        ("throughput", throughput,
         "offline throughput of LLM.generate on a workload (optionally vs transformers or vLLM)",
         "Offline throughput: Conveyor's LLM.generate on all prompts at once (only the generate call is timed, "
         "after a small warm-up); --compare hf also runs transformers' generate_batch and static generate on the "
         "same weights and compares greedy outputs; --compare vllm runs vLLM's offline LLM in the interpreter "
         "--vllm-python names, on the same prompt ids and settings, and reports its tok/s and greedy agreement."),
        ("serve", serve,
         "online serving benchmark of any OpenAI-compatible server over HTTP (like vllm bench serve)",
         "Streams a workload's requests to an OpenAI-compatible server (Conveyor's, vLLM, llama-server) with "
         "Poisson arrivals at --request-rate (or all at once) and an optional concurrency cap; reports request "
         "and token throughput and mean/median/p90/p99 TTFT, TPOT, ITL and E2E latency in ms, as vllm bench "
         "serve does. --launch starts Conveyor's own server for the run, in the --dtype/--quantization asked "
         "for. Exit code 1 if any request failed."),
        ("perplexity", perplexity,
         "perplexity of a model on a text file, scored in windows through prompt logprobs",
         "Tokenizes the text and scores it in windows of --window tokens (each one prompt with prompt_logprobs=0 "
         "and max_new_tokens=1, all in one LLM.generate call); with --stride below the window only tokens not "
         "scored before count (sliding-window perplexity). Reports perplexity, tokens scored, tokens/s and the "
         "model, dtype and quantization. Exit code 1 if any window failed."),
        ("decode", decode,
         "decode tok/s at depth (long prompts, each KV cache dtype) and the bytes a step reads vs bandwidth",
         "Streams of --context random prompt tokens decode --tokens tokens together; the KV cache dtypes asked "
         "for run interleaved repeat by repeat (and llama.cpp's llama-bench -d at the same depth with "
         "--llama-bench). Reports decode tok/s (median and spread), the bytes a step reads (weights + KV) and "
         "their rate against the machine's measured read bandwidth."),
        ("embed", embed,
         "embedding throughput of a pooling model over many texts (optionally vs vLLM)",
         "--num-texts random texts of --text-len tokens embedded in one LLM(runner='pooling').embed call, "
         "--repeats times after a warm-up; reports prompt tok/s (median and spread). --compare vllm runs vLLM's "
         "pooling LLM.embed on the same token ids in the interpreter --vllm-python names and reports its tok/s, "
         "the ratio and the cosine similarity of the two engines' embeddings."),
        ("lora", lora,
         "a batch of streams over several LoRA adapters and the base vs the same batch on the base alone",
         "--streams random prompts generate --tokens tokens each in one generate, spread over --adapters random "
         "PEFT adapters of --rank and the base model, then all on the base model, on the same engine, alternated "
         "--repeats times. Reports output tok/s of each run (median and spread) and their ratio."),
    ]
    for name, module, help_text, description in commands:
        p = subparsers.add_parser(name, help=help_text, description=description)
        module.add_arguments(p)
        p.set_defaults(func=module.run_from_args)


def main(argv: Sequence[str] | None = None, prog: str = "python -m conveyor.bench") -> int:
    """Run a benchmark subcommand; returns the exit code. `prog` names the command in usage messages."""
    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        for module, extra in REQUIRES.get(args.command, ()):
            require(module, extra, f"{prog} {args.command}")
    except MissingDependencyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return args.func(args)
