"""The bridge between HTTP requests and the shared engine: admission, request building, results.

One HTTP request becomes one engine request per (prompt, choice); they are submitted to the
shared `ContinuousBatchingManager` as one `Submission` (submission.py), whose `on_output` callback
hands every output to the event loop (`handoff`: one wake-up per engine step, off the engine's
critical path), where a request's outputs not yet sent are coalesced into one. Tokenizing, chat templates and constraint
compilation run on a small thread pool (`prepare`), never on the event loop. The server
counts accepted engine requests until their final output arrives; past `max_queue` it answers
503. Whatever ends the HTTP exchange (response sent, client gone, shutdown timeout) cancels the
engine requests still running, so their KV blocks return to the pool within a step.

If the engine loop dies, the requests in flight end with its "error" (500s naming the cause, or
an error event in a stream), new requests and /health get 503, and the server drains and calls
`on_engine_death` (the foreground server exits non-zero then, for a supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import InvalidRequestError, RequestErrorCode
from ..llm import LLM
from ..lora_request import LoRARequest
from ..manager import EngineDeadError, death_message
from ..request import Request, RequestOutput
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .dashboard_data import STEP_HISTORY
from .handoff import Handoff
from .limits import default_max_request_bytes, prompt_char_limit
from .logprobs import LogprobRenderer
from .metrics import ServerMetrics
from .observers import RequestObservers
from .protocol import APIError, ChatMessage, CompletionRequest, SamplingFields
from .response_format import body_constraint, logit_bias
from .settings import ServerSettings
from .stats_log import StatsLog
from .submission import Submission
from ..reasoning import ReasoningParser, get_reasoning_parser
from ..tool_parsers import ToolParser, detect_parser, get_parser
from .tools import ToolPlan, conversation

logger = logging.getLogger("conveyor.server")

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
PREPARE_THREADS = 2  # requests tokenized at once; the others wait their turn, the event loop does not
T = TypeVar("T")


@dataclass
class ChatPrompt:
    """A rendered conversation: its text (whose end a reasoning parser reads) and its token ids."""

    text: str
    ids: list[int]


class Serving:
    def __init__(self, llm: LLM, settings: ServerSettings) -> None:
        self.llm = llm
        self.settings = settings
        self.names = list(settings.served_model_names or [llm.model_name])
        self.model_name = self.names[0]
        self.tokenizer = llm.get_tokenizer()
        self.chat_template = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else ""
        self.tool_parser = get_parser(settings.tool_call_parser or detect_parser(self.chat_template))
        self.keep_special = drops_a_marker(self.tokenizer, self.tool_parser)
        name = settings.reasoning_parser
        self.reasoning_parser = get_reasoning_parser(name) if name else None
        self.keep_reasoning_special = self.reasoning_parser is not None and drops_a_marker(self.tokenizer,
                                                                                           self.reasoning_parser)
        if name and llm.reasoning_markers is None:  # an LLM built without them: the parser's (`reasoning_state`)
            try:
                llm.set_reasoning_config({"reasoning_parser": name})
            except ValueError as exc:
                logger.info("%s: thinking_token_budget is refused, and output constraints apply from the first "
                            "token", exc)
        self.ignored_fields: set[str] = set()  # request fields logged as ignored (once per name)
        self.max_model_len = llm.max_model_len
        self.max_logprobs = llm.vocab_size if settings.max_logprobs == -1 else settings.max_logprobs
        self.logprobs = LogprobRenderer(self.tokenizer)
        self.max_request_bytes = settings.max_request_bytes or default_max_request_bytes(self.max_model_len)
        self.max_prompt_chars = prompt_char_limit(self.tokenizer, self.max_model_len)  # None: no bound
        # Tokenizing and chat templates run here, off the event loop: /health and the streams in flight
        # never wait for a long prompt (the tokenizer releases the GIL while it encodes).
        self.workers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="conveyor-prepare")
        self.metrics = ServerMetrics(llm.stats, self.model_name, llm.kv_cache_resident_bytes)
        self.observers = RequestObservers.from_settings(settings, self.tokenizer, self.model_name)  # logs, traces
        llm.enable_step_history(STEP_HISTORY)  # the dashboard's strip chart
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handoff: Handoff | None = None  # engine outputs to the loop (started with the loop)
        self.in_flight = 0  # engine requests accepted and not yet finished
        self.active: set[Submission] = set()
        self.draining = False
        self._drain_task: asyncio.Task[None] | None = None
        self._stats_task: asyncio.Task[None] | None = None  # the periodic stats line (`stats_log`)
        self.created = int(time.time())
        self.on_engine_death: Callable[[], None] | None = None  # after the drain that follows a death
        for adapter in settings.lora_modules:  # --lora-modules: checked against the model now, not at a request
            llm.add_lora(adapter)
        # ids of adapters loaded at run time (/v1/load_lora_adapter), after those of --lora-modules
        self.lora_ids = itertools.count(max((a.lora_int_id for a in llm.list_loras()), default=0) + 1)

    # -- lifecycle --------------------------------------------------------------------------
    def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.handoff = handoff = Handoff(self.loop)
        self.llm.manager.start()
        if self.settings.log_stats_interval is not None:
            self._stats_task = self.loop.create_task(StatsLog(self.llm.stats, self.settings.log_stats_interval).run())
        # Through the handoff too: after the outputs that failed the requests in flight.
        self.llm.manager.add_death_callback(lambda exc: handoff.put(self.engine_died, exc))
        logger.info("serving %s (%s) at %s: context %d tokens, KV cache capacity %d tokens, max queue %d",
                    self.model_name, self.llm.model_path, self.settings.url or "(given sockets)", self.max_model_len,
                    self.llm.kv_capacity_tokens, self.settings.max_queue)
        logger.info("tool calls: %s parser (%s), tool_choice \"auto\" %s", self.tool_parser.name,
                    "--tool-call-parser" if self.settings.tool_call_parser else "read off the chat template",
                    "on" if self.settings.enable_auto_tool_choice else "off (--enable-auto-tool-choice)")
        logger.info("reasoning: %s", f"split from the answer by the {self.reasoning_parser.name} parser"
                    if self.reasoning_parser else "not split from the answer (--reasoning-parser)")

    def request_shutdown(self, then: Callable[[], None]) -> bool:
        """From a signal handler: drain on the event loop, then call `then` (there). False if not started."""
        if self.loop is None or self.loop.is_closed():
            return False
        self.loop.call_soon_threadsafe(self.begin_drain, then)
        return True

    def begin_drain(self, then: Callable[[], None] | None = None) -> None:
        """Stop admitting (503); abort what is still running after `shutdown_timeout` seconds; then `then()`."""
        if not self.draining:
            self.draining = True
            logger.info("shutting down: %d request(s) in flight get %g s to finish", self.in_flight,
                        self.settings.shutdown_timeout)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        if then is not None and self._drain_task is not None:
            self._drain_task.add_done_callback(lambda _: then())

    @property
    def dead_error(self) -> BaseException | None:
        return self.llm.manager.dead_error

    def engine_died(self, exc: BaseException) -> None:
        """On the event loop, after the outputs that failed the requests in flight: drain, then `on_engine_death`."""
        logger.critical("%s; answering 503 from now on%s", death_message(exc),
                        ", exiting once in-flight requests are answered" if self.on_engine_death else "")
        self.begin_drain(then=self.on_engine_death)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.in_flight:
            logger.warning("shutdown timeout: aborting %d request(s)", self.in_flight)
            for sub in list(self.active):
                sub.cancel()
            deadline = loop.time() + 5.0  # the aborts' final outputs, so that their clients are answered
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        self.begin_drain()
        if self._drain_task is not None:
            await self._drain_task
        await asyncio.to_thread(self.llm.manager.stop, 10.0)
        self.observers.close()  # after the last requests' ends
        self.workers.shutdown(wait=False, cancel_futures=True)
        if self.handoff is not None:
            self.handoff.run()  # the aborts' outputs the stop published, if any
            self.handoff.close()

    # -- admission --------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names (None: the base model); a 404 naming it when it is
        neither the base model nor a loaded adapter."""
        if not model or model in self.names:
            return None
        adapter = self.llm.get_lora(model)
        if adapter is None:
            served = self.names + [a.lora_name for a in self.llm.list_loras()]
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(served)}.",
                           param="model", code="model_not_found")
        return adapter

    def reply_model(self, adapter: LoRARequest | None) -> str:
        """The `model` a reply reports: the adapter's name, else the base model's (vLLM's)."""
        return adapter.lora_name if adapter is not None else self.model_name

    def unavailable(self, message: str, code: str) -> APIError:
        self.metrics.rejected.inc()
        return APIError(503, message, type="service_unavailable_error", code=code,
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    def submit(self, requests: list[Request]) -> Submission:
        if self.dead_error is not None:
            raise self.dead()
        if self.draining:
            raise self.unavailable("The server is shutting down.", "server_shutting_down")
        limit = self.settings.max_queue
        if len(requests) > limit:
            raise APIError(400, f"the request asks for {len(requests)} generations (prompts x n), over the "
                           f"server's max queue of {limit}", param="n")
        if self.in_flight + len(requests) > limit:
            raise self.unavailable(f"The server is at capacity ({self.in_flight} requests in flight, max queue "
                                   f"{limit}); retry later.", "server_overloaded")
        sub = Submission(self, requests)
        try:
            sub.start()
        except EngineDeadError:
            sub.cancel()
            raise self.dead() from None
        return sub

    def dead(self) -> APIError:
        return self.unavailable(f"The engine is not serving: {death_message(self.dead_error)}; the server needs "
                                "a restart.", "engine_dead")

    @property
    def thinking_budgets(self) -> bool:
        """Whether requests' thinking budgets are enforced (the engine knows the reasoning markers)."""
        return self.llm.reasoning_markers is not None

    @property
    def constraints_after_reasoning(self) -> bool:
        """Whether an output constraint applies after the reply's reasoning (the markers known, and not vLLM's
        enable_in_reasoning), so that a constrained reply is read as any other."""
        return self.thinking_budgets and not self.llm.structured_outputs_config.enable_in_reasoning

    # -- building requests ------------------------------------------------------------------
    async def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the preparing threads (tokenizing, templates, constraints), not the loop."""
        assert self.loop is not None, "the server's lifespan has not started"
        return await self.loop.run_in_executor(self.workers, functools.partial(fn, *args, **kwargs))

    def check_length(self, text: str, param: str) -> None:
        """A prompt text too long to fit the context whatever its tokens (limits.prompt_char_limit): a 400
        without tokenizing it."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"the prompt has {len(text)} characters; no text over {limit} characters fits the "
                           f"model's context length of {self.max_model_len} tokens (its longest token is "
                           f"{limit // self.max_model_len} characters)", param=param, code="context_length_exceeded")

    def completion_prompts(self, body: CompletionRequest) -> list[str | list[int]]:
        """The body's prompts, checked (empty, too long to fit): texts still untokenized (`tokenize`)."""
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "prompt is empty", param="prompt")
                if body.truncate_prompt_tokens is None:  # else its tail is kept, however long
                    self.check_length(p, "prompt")
        return prompts

    def tokenize(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt (call it off the event loop: `prepare`)."""
        return [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else list(p)
                for p in prompts]

    def render_chat(self, messages: list[ChatMessage], tools: ToolPlan | None = None) -> list[int]:
        """The conversation's token ids (call it off the event loop: `prepare`)."""
        return self.render_chat_prompt(messages, tools).ids

    def render_chat_prompt(self, messages: list[ChatMessage], tools: ToolPlan | None = None, *,
                           truncating: bool = False, add_special_tokens: bool = False, **options: Any) -> ChatPrompt:
        """The conversation rendered, `options` as `LLM.render_chat_text`'s (`replies.template_options`);
        `truncating`: its tail will be kept (`truncate_prompt_tokens`), however long; `add_special_tokens`: the
        tokenizer's BOS over the template's own (vLLM's field). Call it off the event loop (`prepare`)."""
        turns, template_tools = conversation(messages, tools or ToolPlan(), self.chat_template, CHAT_ROLES)
        try:
            text = self.llm.render_chat_text(turns, tools=template_tools, **options)
        except InvalidRequestError as exc:  # options that do not go together
            raise APIError(400, str(exc), param=exc.param) from exc
        except Exception as exc:  # no chat template, or the template rejected the conversation
            raise APIError(400, f"cannot apply the model's chat template: {exc}", param="messages") from exc
        if not truncating:
            self.check_length(text, "messages")
        return ChatPrompt(text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def build_requests(self, prefix: str, prompts: list[list[int]], body: SamplingFields, max_tokens: int | None,
                       logprobs: int | None, param: str, prompt_logprobs: int | None = None,
                       constraint: tuple[StructuredOutputsParams | None, str | None] = (None, None),
                       keep_special: bool = False, lora_request: LoRARequest | None = None) -> list[Request]:
        """Engine requests (validated, constraints compiled: call it off the event loop) for the prompts x n.
        constraint: a tool choice's (constraint, field); else the body's response_format / structured_outputs.
        keep_special: decode special tokens into the text (a tool parser's markers). lora_request: the adapter
        they run with (`check_model`)."""
        structured, structured_param = body_constraint(body)
        if constraint[0] is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice constrains the output; it cannot be combined with "
                               f"{structured_param}", param="tool_choice")
            structured, structured_param = constraint
        bias = logit_bias(body)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        default = self.llm.get_default_sampling_params()  # the model's generation config over ours (vLLM)
        unset = {name: getattr(default, name) if getattr(body, name) is None else getattr(body, name)
                 for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        unset["top_k"] = max(unset["top_k"], 0)  # -1: off, as 0
        if body.seed is not None and not -2**63 <= body.seed <= 2**64 - body.n:
            raise APIError(400, f"seed must be a 64-bit integer, got {body.seed}", param="seed")
        requests = []
        for p, ids in enumerate(prompts):
            limit = max_tokens
            if limit is None:  # vLLM: the rest of the context (capped by the generation config)
                limit = self.llm.default_max_tokens(len(ids))
                if limit < 1:
                    raise APIError(400, f"prompt ({len(ids)} tokens) leaves no room to generate within the model's "
                                   f"context length of {self.max_model_len} tokens", param=param,
                                   code="context_length_exceeded")
            prompt = salted(ids, body.cache_salt)
            try:
                params = SamplingParams(
                    max_new_tokens=limit, n=body.n, **unset,
                    presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                    min_tokens=body.min_tokens, seed=body.seed, stop=stop,
                    stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs, structured_outputs=structured, logit_bias=bias,
                    allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words or [],
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens and not keep_special,
                    request_timeout=body.request_timeout or self.settings.request_timeout, priority=body.priority,
                    thinking_token_budget=body.thinking_token_budget)
                for j in range(body.n):  # choice j: its own request, seeded seed + j
                    requests.append(self.llm.make_request(f"{prefix}-{p * body.n + j}", prompt, params.for_sample(j),
                                                          lora_request))
            except InvalidRequestError as exc:
                raise request_error(exc, param, structured_param) from exc
            except (ValueError, OverflowError, RuntimeError) as exc:  # SamplingParams; torch for a bad seed
                raise APIError(400, str(exc), param="logit_bias" if "logit_bias" in str(exc) else None) from exc
        return requests


def drops_a_marker(tokenizer: Any, parser: type[ToolParser] | type[ReasoningParser]) -> bool:
    """Whether the tokenizer holds one of the parser's markers as a special token that decoding with
    skip_special_tokens would drop (Mistral's `[TOOL_CALLS]`, gpt-oss's channels): then the replies the
    parser reads keep them."""
    for marker in parser.special:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and not tokenizer.decode(ids, skip_special_tokens=True):
            return True
    return False


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompts: Iterable[list[int]], finals: Iterable[RequestOutput | int],
          cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached` (--enable-prompt-tokens-details): the prompt tokens the prefix cache held."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(f if isinstance(f, int) else f.num_output_tokens for f in finals)
    counts: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                              "total_tokens": prompt_tokens + completion}
    if cached is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
    return counts


def salted(ids: list[int], salt: str | None) -> list[int] | dict[str, Any]:
    """A prompt of token ids with vLLM's `cache_salt` (its prefix cache shared only within the salt)."""
    return ids if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}


def request_error(exc: InvalidRequestError, prompt_param: str, structured_param: str | None) -> APIError:
    """The 400 for a request the engine refused, by its code: the body field at fault, and OpenAI's
    `context_length_exceeded` where it applies."""
    message, field = str(exc), prompt_param
    if exc.code is RequestErrorCode.INVALID_STRUCTURED_OUTPUTS:  # the constraint did not compile
        message, field = f"invalid {structured_param}: {message}", structured_param
    elif exc.param in BODY_FIELDS:
        field = BODY_FIELDS[exc.param]
    code = exc.code.value if exc.code is RequestErrorCode.CONTEXT_LENGTH_EXCEEDED else None
    return APIError(400, message, param=field, code=code)


# `SamplingParams` fields an engine error may name -> the request body's field (others: the prompt's).
BODY_FIELDS = {"logit_bias": "logit_bias", "priority": "priority", "dimensions": "dimensions",
               "allowed_token_ids": "allowed_token_ids", "thinking_token_budget": "thinking_token_budget"}
