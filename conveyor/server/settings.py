"""`ServerSettings`: what `conveyor serve`'s server options set (the engine's are `ContinuousBatchingConfig`),
checked once at start. An operational concern with several settings keeps them in its own module (`cors`,
`tracing`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..lora_request import LoRARequest
from .cors import CORSSettings
from .log_format import endpoint_list
from .protocol import MAX_LOGPROBS
from .responses.store import DEFAULT_CAPACITY
from .tls import TLSSettings
from .tracing import TracingSettings


@dataclass
class ServerSettings:
    """served_model_names: names accepted in `model` (the first is reported); None = the model's
    file or directory name. api_key: required as `Authorization: Bearer KEY` on /v1/*, /tokenize
    and /detokenize. max_queue: most engine requests (prompts x n) accepted and not yet finished.
    shutdown_timeout: seconds in-flight requests get to finish after SIGINT/SIGTERM.
    enable_auto_tool_choice: accept `tool_choice: "auto"` (vLLM's flag; without it "auto" is a 400).
    tool_call_parser: the format of the model's own tool calls (`tool_parsers.TOOL_PARSERS`); None =
    read off the chat template. max_request_bytes: the largest request body (413 past it); None =
    derived from the context length (`limits.default_max_request_bytes`). max_stored_responses: most
    Responses API responses kept for GET and previous_response_id (`responses.store`).
    reasoning_parser: the format of the model's reasoning (`reasoning.REASONING_PARSERS`), split from
    the answer; None = not split. default_chat_template_kwargs: template variables every chat request
    gets under its own. cors: cross-origin requests (`cors`); None = off. enable_log_requests,
    log_prompts, enable_log_outputs, max_log_len: the request log (`request_log`); log_format: "text" or "json"
    (`log_format`); disable_uvicorn_access_log: no line per HTTP request from uvicorn;
    disable_access_log_for_endpoints: none for these paths (vLLM's: a load balancer's probes). request_timeout:
    the deadline of requests that set none (`SamplingParams.request_timeout`); None = none. tracing:
    OpenTelemetry spans (`tracing`); None = off. lora_modules: LoRA adapters served by name from the start
    (`--lora-modules`); allow_runtime_lora_updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    answer (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, read from the environment by default). dev_mode: vLLM's
    development endpoints answer (VLLM_SERVER_DEV_MODE, from the environment by default).
    enable_tokenizer_info_endpoint: GET /tokenizer_info answers (vLLM's flag). log_stats_interval:
    seconds between the periodic stats lines (`stats_log`); None = none. tls: HTTPS (`tls`); None = off.
    vLLM's: return_tokens_as_token_ids (every request's default), enable_force_include_usage (a usage
    chunk closes every stream), enable_prompt_tokens_details (usage counts the cached prompt tokens),
    response_role (a chat reply's role), root_path (the prefix a proxy serves the app under),
    disable_fastapi_docs (no /docs, /redoc, /openapi.json), enable_request_id_headers (X-Request-Id),
    max_logprobs (the most logprobs a request may ask for; -1: the vocabulary)."""

    served_model_names: list[str] | None = None
    api_key: str | None = None
    max_queue: int = 512
    shutdown_timeout: float = 10.0
    retry_after_s: int = 1
    url: str | None = None  # for the start-up log line
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    max_request_bytes: int | None = None
    max_stored_responses: int = DEFAULT_CAPACITY
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict[str, Any] | None = None
    cors: CORSSettings | None = None
    enable_log_requests: bool = False
    log_prompts: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    log_format: str = "text"
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    request_timeout: float | None = None
    tracing: TracingSettings | None = None
    lora_modules: list[LoRARequest] = field(default_factory=list)
    allow_runtime_lora_updating: bool = field(default_factory=lambda: runtime_lora_updating(os.environ))
    dev_mode: bool = field(default_factory=lambda: dev_mode(os.environ))
    enable_tokenizer_info_endpoint: bool = False
    log_stats_interval: float | None = None
    tls: TLSSettings | None = None
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    enable_prompt_tokens_details: bool = False
    response_role: str = "assistant"
    root_path: str = ""
    disable_fastapi_docs: bool = False
    enable_request_id_headers: bool = False
    max_logprobs: int = MAX_LOGPROBS

    @classmethod
    def from_args(cls, args: Any) -> ServerSettings:
        """The settings of `conveyor serve`'s parsed options (`cli_args.add_serve_args`), checked."""
        if args.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
        if args.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        if args.max_request_bytes is not None and args.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
        if args.max_stored_responses < 0:
            raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
        for flag, on in (("--log-prompts", args.log_prompts), ("--enable-log-outputs", args.enable_log_outputs)):
            if on and not args.enable_log_requests:
                raise ValueError(f"{flag} takes effect only with --enable-log-requests (the request log)")
        if args.max_log_len is not None and args.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
        if args.request_timeout is not None and not 0 < args.request_timeout < float("inf"):
            raise ValueError(f"--request-timeout must be a number of seconds > 0, got {args.request_timeout}")
        if args.chat_template_content_format == "openai":
            raise ValueError("--chat-template-content-format openai is not supported: a message's text parts reach "
                             "the chat template joined into one string (vLLM's 'string'; 'auto' takes that too)")
        if args.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be -1 (the vocabulary) or >= 0, got {args.max_logprobs}")
        if not 0 < args.log_stats_interval < float("inf"):
            raise ValueError(f"--log-stats-interval must be a number of seconds > 0, got {args.log_stats_interval}")
        kwargs = args.default_chat_template_kwargs
        try:
            kwargs = None if kwargs is None else json.loads(kwargs)
        except ValueError as exc:
            raise ValueError(f"--default-chat-template-kwargs is not valid JSON: {exc}") from exc
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object, e.g. "
                             "'{\"enable_thinking\": false}'")
        return cls(served_model_names=args.served_model_name, api_key=args.api_key, max_queue=args.max_queue,
                   shutdown_timeout=args.shutdown_timeout, enable_auto_tool_choice=args.enable_auto_tool_choice,
                   tool_call_parser=args.tool_call_parser, max_request_bytes=args.max_request_bytes,
                   max_stored_responses=args.max_stored_responses, reasoning_parser=args.reasoning_parser,
                   default_chat_template_kwargs=kwargs, cors=CORSSettings.from_args(args),
                   enable_log_requests=args.enable_log_requests, log_prompts=args.log_prompts,
                   enable_log_outputs=args.enable_log_outputs,
                   max_log_len=args.max_log_len, log_format=args.log_format,
                   disable_uvicorn_access_log=args.disable_uvicorn_access_log, request_timeout=args.request_timeout,
                   disable_access_log_for_endpoints=endpoint_list(args.disable_access_log_for_endpoints),
                   tracing=TracingSettings.from_args(args),
                   lora_modules=lora_modules(getattr(args, "lora_modules", None), getattr(args, "enable_lora", False)),
                   enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                   log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
                   tls=TLSSettings.from_args(args), return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   enable_force_include_usage=args.enable_force_include_usage,
                   enable_prompt_tokens_details=args.enable_prompt_tokens_details, response_role=args.response_role,
                   root_path=args.root_path, disable_fastapi_docs=args.disable_fastapi_docs,
                   enable_request_id_headers=args.enable_request_id_headers, max_logprobs=args.max_logprobs)


def dev_mode(environ: Any) -> bool:
    """vLLM's switch for its development endpoints (here /reset_prefix_cache): VLLM_SERVER_DEV_MODE=1 or true."""
    return environ.get("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true")


def runtime_lora_updating(environ: Any) -> bool:
    """vLLM's switch for the run-time adapter endpoints: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true."""
    return environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def lora_modules(items: list[str] | None, enabled: bool) -> list[LoRARequest]:
    """`--lora-modules`' adapters, ids 1, 2, ... in order: `name=path` or vLLM's JSON object with `name`,
    `path` and optionally `base_model_name`; ValueError naming the item that is neither."""
    if items and not enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    adapters: list[LoRARequest] = []
    for i, item in enumerate(items or [], start=1):
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                adapters.append(LoRARequest(spec["name"], i, spec["path"], spec.get("base_model_name")))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"--lora-modules {item!r}: vLLM's JSON form is an object with name, path and "
                                 f"optionally base_model_name ({exc!r})") from None
            continue
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: give name=path or vLLM's JSON object")
        adapters.append(LoRARequest(name, i, path))
    if len({a.lora_name for a in adapters}) != len(adapters):
        raise ValueError("--lora-modules names an adapter twice")
    return adapters
