"""The command-line options that build an engine and a server: one module that `conveyor generate`,
`conveyor serve` and the benchmarks that launch a server (`bench launch`) all read. Choices come from
the registries (`QUANTIZATIONS`, `SCHEDULERS`, `ATTENTION_BACKENDS`), fields from
`ContinuousBatchingConfig`."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

from .config import ContinuousBatchingConfig
from .layers.attention import ATTENTION_BACKENDS
from .layers.quantization.registry import QUANTIZATIONS
from .sched.scheduler import SCHEDULERS
from .tool_parsers import TOOL_PARSERS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model and `ContinuousBatchingConfig` options shared by every command that builds an engine."""
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: built-in "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--dtype", default="auto", help="auto (default: bf16 on CUDA and on CPUs with native bf16, "
                        "else fp32), float32 (the exact path), bfloat16 or float16")
    parser.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                        help="weight format (default: gguf for a quantized GGUF file unless --dtype float32, else none)")
    for f in fields(ContinuousBatchingConfig):
        if f.type in ("int", "int | None"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=None)
        elif f.type in ("float", "float | None"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=None)
        elif f.type == "bool | None":  # --use-cuda-graph / --no-use-cuda-graph; absent = auto
            parser.add_argument(f"--{f.name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--scheduler-type", choices=list(SCHEDULERS), default=None)
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
    add_tool_and_body_args(parser)
    add_engine_args(parser)


def add_tool_and_body_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling flags, and the request body limit."""
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='accept tool_choice "auto" (also the default when a request gives tools), the model '
                        "writing its own calls; without it such requests get a 400, as in vLLM")
    parser.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS), metavar="NAME",
                        help="the format of the model's own tool calls: " + ", ".join(TOOL_PARSERS) +
                        " (default: read off the chat template; hermes when it says nothing)")
    parser.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                        help="largest request body, answered 413 past it before it is parsed (default: "
                        "256 bytes per token of the context, at least 16 MiB)")
