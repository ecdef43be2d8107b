"""The command-line options that build an engine and a server: one module that `conveyor generate`,
`conveyor serve` and the benchmarks that launch a server (`bench launch`) all read. Choices come from
the registries (`QUANTIZATIONS`, `SCHEDULERS`, `ATTENTION_BACKENDS`), fields from
`ContinuousBatchingConfig`, vLLM's names from `config.VLLM_ENGINE_ARGS`. Options come in groups (model,
engine and scheduling, vLLM's names, server) so that `--help` reads like vLLM's."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import fields
from typing import Any

from .cache.kv_format import KV_CACHE_DTYPES
from .config import SCHEDULING_POLICIES, ContinuousBatchingConfig, with_vllm_engine_args
from .layers.attention import ATTENTION_BACKENDS
from .layers.quantization.registry import ALIASES, QUANTIZATIONS
from .models.pooling import CONVERTS, RUNNERS, TASKS
from .reasoning import REASONING_PARSERS
from .sched.scheduler import SCHEDULERS
from .tool_parsers import TOOL_PARSERS

MODEL_FIELDS = ("max_model_len", "seed")  # config fields that are model options in vLLM's --help
SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}  # vLLM's short forms of config fields' flags
# A server's token budget a step unless told (vLLM's CPU server default; `LLM` keeps the config's 512): with
# requests arriving while others decode, a larger budget finishes prompts in fewer steps, each of which
# also carries every decoding row (docs/benchmarks.md, "Served").
SERVE_MAX_BATCH_TOKENS = 2048


def human_int(value: str, letters: str = "kmgt") -> int | None:
    """vLLM's human-readable integers: a lower-case letter of `letters` multiplies by a power of 1000 (a
    fraction allowed: 25.6k), an upper-case one (or with an i: Ki) by a power of 1024; None if malformed."""
    match = re.fullmatch(rf"(\d+(?:\.\d+)?)(?:([{letters}])|([{letters.upper()}])i?)?", value.strip())
    if match is None or ("." in match[1] and not match[2]):
        return None
    if match[2]:
        return int(float(match[1]) * 1000 ** (letters.index(match[2]) + 1))
    return int(match[1]) * (1024 ** (letters.index(match[3].lower()) + 1) if match[3] else 1)


def token_count(value: str) -> int:
    """A token count as vLLM's `--max-model-len` takes it: 2048, 32k (32000), 25.6k, 32K or 32Ki (32768)."""
    count = human_int(value, "k")
    if count is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a token count (e.g. 2048, 32k = 32000, 32K = 32768)")
    return count


def byte_count(value: str) -> int:
    """A size as vLLM's `--kv-cache-memory-bytes` takes it: 4294967296, 4g (4 x 10^9), 4G or 4Gi (4 x 2^30)."""
    count = human_int(value)
    if count is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of bytes (e.g. 4294967296, 4g = 4 x 10^9, "
                                         "4G = 4 x 2^30)")
    return count


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None, help="HF model directory, .gguf file or Hugging Face Hub id (org/name, "
                       "org/name:QUANT for a GGUF repo's file of that quant type) (default: built-in "
                       "SmolLM2-135M-Instruct)")
    group.add_argument("--revision", default=None, help="the Hub revision (branch, tag or commit) of a Hub id")
    group.add_argument("--download-dir", default=None, metavar="DIR",
                       help="the Hugging Face cache to download into and load from (default: HF_HUB_CACHE, "
                       "~/.cache/huggingface/hub); HF_HUB_OFFLINE=1 uses the cache only")
    group.add_argument("--tokenizer", default=None, metavar="DIR|ORG/NAME",
                       help="a tokenizer used in place of the model's, with its chat template (vLLM's; for a GGUF "
                       "file, the original model's tokenizer)")
    group.add_argument("--gguf-file", default=None, metavar="NAME", help="the GGUF file of a Hub repo or directory")
    group.add_argument("--hf-token", default=None, help="Hugging Face token for gated or private repos (default: "
                       "HF_TOKEN, else the one `hf auth login` saved)")
    group.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    group.add_argument("--dtype", default="auto", help="auto (default: bf16 on CUDA and on CPUs with native bf16, "
                       "else fp32), float32 (the exact path), bfloat16 or float16")
    group.add_argument("--quantization", "-q", default=None, choices=[*QUANTIZATIONS, *ALIASES],
                       help="weight format (default: the file's own: gguf for a quantized GGUF file, mxfp4, "
                       "compressed-tensors, gptq or awq for such a checkpoint, unless --dtype float32; else none; "
                       "gptq_marlin and awq_marlin, vLLM's names, are gptq and awq)")
    group.add_argument("--max-model-len", type=token_count, default=None, metavar="TOKENS",
                       help="the context length served (prompt + generated tokens), at most the model's; "
                       "2048, 32k (32000) or 32K (32768) (default: the model's)")
    group.add_argument("--seed", type=int, default=None,
                       help="engine seed: requests without a seed sample from generators seeded by it and their "
                       "arrival order, so a run repeats exactly (default: unseeded)")
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file, or the template itself, used instead of the model's")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="auto (default): the model's generation_config.json gives the sampling defaults of "
                       "what a request leaves unset; vllm: ignore it; DIR: that directory's file")
    group.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help='sampling defaults over the generation config, e.g. \'{"temperature": 0.5}\'')
    group.add_argument("--hf-overrides", default=None, metavar="JSON",
                       help="model config fields set over the checkpoint's (vLLM's), e.g. "
                       '\'{"is_matryoshka": true}\'')
    lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters beside the base model")
    lora.add_argument("--max-loras", type=int, default=None, metavar="N",
                      help="adapters in one batch (default 1): each holds a slot of stacked weights")
    lora.add_argument("--max-lora-rank", type=int, default=None, metavar="R", help="the largest rank taken (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                      help="adapters kept loaded in host memory (default: --max-loras)")
    pooling = parser.add_argument_group("pooling models (embeddings, scoring)")
    pooling.add_argument("--runner", default="auto", choices=RUNNERS,
                         help="pooling: embed or score prompts (/v1/embeddings, /v1/score, /v1/rerank) instead of "
                         "generating; auto (default): pooling for *ForSequenceClassification and bare *Model "
                         "architectures, else generate")
    pooling.add_argument("--convert", default="auto", choices=CONVERTS,
                         help="the pooling task: embed, or classify (scores: a classifier head, or "
                         "--hf-overrides' classifier_from_token); auto: from the architecture")
    pooling.add_argument("--task", default=None, choices=list(TASKS),
                         help="vLLM's older form: embed = --runner pooling --convert embed; classify, score = "
                         "--convert classify; generate")
    pooling.add_argument("--pooler-config", "--override-pooler-config", default=None, metavar="JSON",
                         help='how to pool: \'{"pooling_type": "MEAN", "normalize": false}\' (LAST, MEAN or CLS; '
                         "default: the checkpoint's sentence-transformers files, else LAST, normalized); "
                         '\'{"task": "token_embed"}\' (or token_classify): one output a token, on /pooling')


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model, `ContinuousBatchingConfig` and vLLM-named options, shared by every command that builds an engine."""
    add_model_args(parser)
    group = parser.add_argument_group("engine and scheduling (ContinuousBatchingConfig; docs/configuration.md)")
    for f in fields(ContinuousBatchingConfig):
        flags = [f"--{f.name.replace('_', '-')}", *SHORT_FLAGS.get(f.name, [])]
        if f.name in MODEL_FIELDS:
            continue
        if f.name == "kv_cache_memory_bytes":
            group.add_argument(*flags, type=byte_count, default=None, metavar="BYTES",
                               help="the KV cache's size (vLLM's; 4G = 4 GiB), over --max-memory-percent")
        elif f.type in ("int", "int | None"):
            group.add_argument(*flags, type=int, default=None)
        elif f.type in ("float", "float | None"):
            group.add_argument(*flags, type=float, default=None)
        elif f.type == "bool | None":  # --use-cuda-graph / --no-use-cuda-graph; absent = auto
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--scheduler-type", choices=list(SCHEDULERS), default=None)
    group.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS), default=None,
                       help="auto (default: Triton on CUDA, native kernels on CPU), torch, cpu or triton")
    group.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                       help="auto (default: the model's dtype), int8 (CPU: about twice the tokens in the same "
                       "memory) or fp8 / fp8_e4m3 / fp8_e5m2 (CUDA, or CPU with --attention-backend torch)")
    group.add_argument("--no-block-sharing", action="store_true", help="turn prefix caching off")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding, vLLM's JSON, e.g. "
                       '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    vllm = parser.add_argument_group("vLLM's names for the options above")
    vllm.add_argument("--max-num-seqs", type=int, default=None, metavar="N", help="--max-requests-per-batch")
    vllm.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N", help="--max-batch-tokens")
    vllm.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                      help="--max-memory-percent: the share of the memory free after the weights and one pass's "
                      "working memory that the KV cache takes (on CPU, of the available system memory; default "
                      "0.9 on CUDA, 0.5 on CPU)")
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                      help="prefix caching (default on; --no-enable-prefix-caching = --no-block-sharing)")
    vllm.add_argument("--block-size", type=int, default=None, metavar="TOKENS", help="--page-size")
    vllm.add_argument("--swap-space", type=float, default=None, metavar="GIB", help="--cpu-offload-space")
    vllm.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: --no-use-cuda-graph")
    vllm.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N", help="--num-blocks")
    vllm.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                      help="--use-async-batching")
    vllm.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default=None,
                      help="fcfs (first come, first served: --scheduler-type fifo or prefill_first) or priority "
                      "(--scheduler-type priority: each request's priority field, lower first, preempting)")


def config_from_args(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The engine configuration; a vLLM name that disagrees with our name for the same option is an error."""
    values = {f.name: getattr(args, f.name) for f in fields(ContinuousBatchingConfig)
              if getattr(args, f.name, None) is not None}
    if args.no_block_sharing:
        values["allow_block_sharing"] = False
    serve_default = getattr(args, "serve_max_batch_tokens", None)  # set by add_serve_args
    if serve_default and "max_batch_tokens" not in values and args.max_num_batched_tokens is None:
        values["max_batch_tokens"] = serve_default
    config = ContinuousBatchingConfig(**values)  # speculative_config: its JSON text, parsed and validated there
    return with_vllm_engine_args(config, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
                                 swap_space=args.swap_space, enforce_eager=args.enforce_eager,
                                 num_gpu_blocks_override=args.num_gpu_blocks_override,
                                 scheduling_policy=args.scheduling_policy, async_scheduling=args.async_scheduling)


def model_from_args(args: argparse.Namespace) -> str | None:
    """The model: `conveyor serve MODEL` or `--model MODEL` (both, if they differ: an error)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"the model is given twice, as {tag!r} and as --model {args.model!r}: give one")
    return tag or args.model


def json_object(text: str | None, flag: str, example: str) -> dict[str, Any] | None:
    """A flag's JSON object (None when not given); ValueError naming the flag otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{example}'")
    return value


def llm_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(**kwargs)` for these options."""
    overrides = json_object(args.override_generation_config, "--override-generation-config", '{"temperature": 0.5}')
    hf_overrides = json_object(args.hf_overrides, "--hf-overrides", '{"is_matryoshka": true}')
    reasoning = json_object(getattr(args, "reasoning_config", None), "--reasoning-config",
                            '{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}')
    structured = json_object(getattr(args, "structured_outputs_config", None), "--structured-outputs-config",
                             '{"enable_in_reasoning": true}')
    return dict(model=model_from_args(args), dtype=args.dtype, quantization=args.quantization, device=args.device,
                config=config_from_args(args), revision=args.revision, download_dir=args.download_dir,
                gguf_file=args.gguf_file, hf_token=args.hf_token, tokenizer=args.tokenizer,
                chat_template=args.chat_template,
                generation_config=args.generation_config, override_generation_config=overrides,
                runner=args.runner, convert=args.convert, task=args.task, pooler_config=args.pooler_config,
                hf_overrides=hf_overrides, enable_lora=args.enable_lora, max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                reasoning_parser=getattr(args, "reasoning_parser", None), reasoning_config=reasoning,
                structured_outputs_config=structured)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model (vLLM's `vllm serve MODEL`)")
    add_engine_args(parser)
    parser.set_defaults(serve_max_batch_tokens=SERVE_MAX_BATCH_TOKENS)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--uds", default=None, metavar="PATH",
                       help="listen on this Unix domain socket instead of --host/--port (vLLM's)")
    group.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                       help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                       "(default: $CONVEYOR_API_KEY, else no key)")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) accepted in requests; the first is reported (default: the Hub id as "
                       "given, else the model's file or directory name)")
    group.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served by name (the request's `model`): name=path, or vLLM's JSON "
                       '\'{"name": ..., "path": ..., "base_model_name": ...}\'; needs --enable-lora')
    group.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="HTTPS: the server's private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, metavar="PATH", help="HTTPS: the server's certificate (PEM)")
    group.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                       help="HTTPS: CA certificates to check client certificates against")
    group.add_argument("--ssl-cert-reqs", type=int, default=0, metavar="N",
                       help="HTTPS: client certificates 0 not asked for (default), 1 optional, 2 required")
    group.add_argument("--root-path", default="", metavar="PATH",
                       help="the path prefix a proxy serves the API under (FastAPI's root_path)")
    group.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="answer with an X-Request-Id header (the request's own, else a new id)")
    group.add_argument("--response-role", default="assistant", metavar="ROLE",
                       help="the role of chat replies to a conversation with a generation prompt (default assistant)")
    group.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                       help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for (default 20; "
                       "-1: the vocabulary)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens token_id:N unless a request says otherwise")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, asked for or not")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage has prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="answer GET /tokenizer_info: the tokenizer's settings and chat template (vLLM's flag; "
                       "lm-evaluation-harness's remote tokenizer reads it)")
    group.add_argument("--max-queue", type=int, default=512,
                       help="most generations (prompts x n) accepted and unfinished; past it, 503 + Retry-After")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted")
    group.add_argument("--log-level", "--uvicorn-log-level", default="info", metavar="LEVEL",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="critical, error, warning, info (default) or debug")
    add_tool_and_body_args(parser)
    add_operations_args(parser)


def add_tool_and_body_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling, reasoning and chat template flags, and the request body limit."""
    group = parser.add_argument_group("tool calling, reasoning and request limits")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='accept tool_choice "auto" (also the default when a request gives tools), the model '
                       "writing its own calls; without it such requests get a 400, as in vLLM")
    group.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS), metavar="NAME",
                       help="the format of the model's own tool calls: " + ", ".join(TOOL_PARSERS) +
                       " (default: read off the chat template; hermes when it says nothing)")
    group.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS), metavar="NAME",
                       help="split the model's reasoning from its answer (message.reasoning_content): " +
                       ", ".join(REASONING_PARSERS) + " (default: not split); its markers are what a "
                       "request's thinking_token_budget counts and forces")
    group.add_argument("--reasoning-config", default=None, metavar="JSON",
                       help="vLLM's reasoning markers for thinking_token_budget, over the parser's: "
                       "'{\"reasoning_start_str\": \"<think>\", \"reasoning_end_str\": \"</think>\"}' (the end "
                       "string is what a spent budget forces)")
    group.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                       help="vLLM's: '{\"enable_in_reasoning\": true}' applies output constraints from the first "
                       "token, reasoning included (default: after the reasoning, where the markers are known); the "
                       "backend is llguidance")
    group.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                       help="chat template variables every chat request gets under its own chat_template_kwargs, "
                       "e.g. '{\"enable_thinking\": false}'")
    group.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                       help="how message content reaches the template: auto / string (vLLM's names; the text parts "
                       "joined into one string, what Conveyor does); openai (a list of parts) is not supported")
    group.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                       help="largest request body, answered 413 past it before it is parsed (default: "
                       "256 bytes per token of the context, at least 16 MiB)")
    group.add_argument("--max-stored-responses", type=int, default=1024, metavar="N",
                       help="most Responses API responses kept in memory for GET and previous_response_id, the "
                       "least recently used going first (default 1024; 0: none)")


def add_operations_args(parser: argparse.ArgumentParser) -> None:
    """What an operator sets in production (vLLM's names where vLLM has them): CORS, logs, deadlines,
    traces (docs/operating.md)."""
    group = parser.add_argument_group("operations: CORS, logs, deadlines, traces")
    group.add_argument("--allowed-origins", default=None, metavar="JSON",
                       help='origins a browser may call from, a JSON list, e.g. \'["http://localhost:3000"]\' '
                       '(\'["*"]\': any); CORS is off without it')
    group.add_argument("--allowed-methods", default=None, metavar="JSON",
                       help='HTTP methods allowed cross-origin (default \'["*"]\')')
    group.add_argument("--allowed-headers", default=None, metavar="JSON",
                       help='request headers allowed cross-origin (default \'["*"]\')')
    group.add_argument("--allow-credentials", action="store_true",
                       help="let browsers send cookies and Authorization headers cross-origin")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log one line per request when it ends: id, prompt length, parameters, outcome, timings")
    group.add_argument("--log-prompts", action="store_true", help="the request log includes each prompt")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="the request log includes each output text (vLLM's flag)")
    group.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="most prompt characters (or token ids) the request log shows (default: all)")
    group.add_argument("--log-format", choices=["text", "json"], default="text",
                       help="text (default) or json: one JSON object per line, for log shippers")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic stats line (throughput, requests, KV cache, prefix cache hit rate)")
    group.add_argument("--log-stats-interval", type=float, metavar="SECONDS",
                       default=float(os.environ.get("VLLM_LOG_STATS_INTERVAL", 10)),
                       help="seconds between stats lines, logged while the engine has work (default: "
                       "$VLLM_LOG_STATS_INTERVAL, else 10)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no access log line per HTTP request")
    group.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                       help="no access log line for these paths, comma-separated, e.g. /health,/metrics (vLLM's)")
    group.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="a request still waiting or running this long after it arrived ends with a 504 and "
                       "finish reason timeout (a request's own request_timeout field wins; default: none)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send a span per request over OTLP to this collector (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "
                       "grpc, the default, or http/protobuf); needs the otel extra")
    group.add_argument("--collect-detailed-traces", default=None, metavar="MODULES",
                       help="model, worker or all (vLLM's values; any adds the request's milestones as span events "
                       "and its inter-token latencies)")
