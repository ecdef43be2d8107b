"""The bridge between HTTP requests and the shared engine: admission, request building, results.

One HTTP request becomes one engine request per (prompt, choice); they are submitted to the
shared `ContinuousBatchingManager` with an `on_output` callback that hands every output to the
event loop (`call_soon_threadsafe`), where they are merged on one asyncio queue. The server
counts accepted engine requests until their final output arrives; past `max_queue` it answers
503. Whatever ends the HTTP exchange (response sent, client gone, shutdown timeout) cancels the
engine requests still running, so their KV blocks return to the pool within a step.

If the engine loop dies, the requests in flight end with its "error" (500s naming the cause, or
an error event in a stream), new requests and /health get 503, and the server drains and calls
`on_engine_death` (the foreground server exits non-zero then, for a supervisor to restart it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError, RequestErrorCode
from ..llm import LLM
from ..manager import EngineDeadError, death_message
from ..request import Request, RequestOutput
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .dashboard_data import STEP_HISTORY
from .metrics import ServerMetrics
from .protocol import APIError, ChatMessage, CompletionRequest, SamplingFields
from .response_format import body_constraint, logit_bias
from .tools import ToolPlan, conversation

logger = logging.getLogger("conveyor.server")

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class ServerSettings:
    """served_model_names: names accepted in `model` (the first is reported); None = the model's
    file or directory name. api_key: required as `Authorization: Bearer KEY` on /v1/*, /tokenize
    and /detokenize. max_queue: most engine requests (prompts x n) accepted and not yet finished.
    shutdown_timeout: seconds in-flight requests get to finish after SIGINT/SIGTERM."""

    served_model_names: list[str] | None = None
    api_key: str | None = None
    max_queue: int = 512
    shutdown_timeout: float = 10.0
    retry_after_s: int = 1
    url: str | None = None  # for the start-up log line


class Submission:
    """The engine requests of one HTTP request, their outputs merged on one asyncio queue."""

    def __init__(self, serving: Serving, requests: list[Request]) -> None:
        self.serving = serving
        self.requests = requests
        self.index = {r.request_id: i for i, r in enumerate(requests)}
        self.unfinished = set(self.index)
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.started = asyncio.Event()  # set by the first output

    def start(self) -> None:
        serving, loop = self.serving, self.serving.loop
        assert loop is not None, "the server's lifespan has not started"

        def deliver(out: RequestOutput) -> None:  # on the engine thread
            if out.finished:
                serving.metrics.observe_finished(out)
            try:
                loop.call_soon_threadsafe(self._arrive, out)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass

        serving.in_flight += len(self.requests)
        serving.active.add(self)
        for k, request in enumerate(self.requests):
            try:
                serving.llm.manager.submit(request, on_output=deliver)
            except EngineDeadError:  # died since the admission check: the unsent ones will never finish
                for unsent in self.requests[k:]:
                    self._finished(unsent.request_id)
                raise

    def _finished(self, request_id: str) -> None:
        self.unfinished.discard(request_id)
        self.serving.in_flight -= 1
        if not self.unfinished:
            self.serving.active.discard(self)

    def _arrive(self, out: RequestOutput) -> None:
        if out.finished and out.request_id in self.unfinished:
            self._finished(out.request_id)
        self.queue.put_nowait(out)
        self.started.set()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as they arrive, until every request has finished."""
        remaining = len(self.requests)
        while remaining:
            out = await self.queue.get()
            remaining -= out.finished
            yield self.index[out.request_id], out

    def cancel(self) -> None:
        """Cancel the requests still running (idempotent; their final "abort" outputs follow)."""
        for request_id in self.unfinished:
            self.serving.llm.manager.cancel_request(request_id)


class Serving:
    def __init__(self, llm: LLM, settings: ServerSettings) -> None:
        self.llm = llm
        self.settings = settings
        self.names = list(settings.served_model_names or [llm.model_name])
        self.model_name = self.names[0]
        self.tokenizer = llm.get_tokenizer()
        self.model_type = getattr(llm.model_config, "model_type", None)  # picks the tool-call parser
        self.max_model_len = llm.max_model_len
        self.metrics = ServerMetrics(llm.stats, self.model_name, llm.kv_cache_resident_bytes)
        llm.enable_step_history(STEP_HISTORY)  # the dashboard's strip chart
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0  # engine requests accepted and not yet finished
        self.active: set[Submission] = set()
        self.draining = False
        self._drain_task: asyncio.Task[None] | None = None
        self.created = int(time.time())
        self.on_engine_death: Callable[[], None] | None = None  # after the drain that follows a death

    # -- lifecycle --------------------------------------------------------------------------
    def startup(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.llm.manager.start()
        loop = self.loop
        self.llm.manager.add_death_callback(lambda exc: loop.call_soon_threadsafe(self.engine_died, exc))
        logger.info("serving %s (%s) at %s: context %d tokens, KV cache capacity %d tokens, max queue %d",
                    self.model_name, self.llm.model_path, self.settings.url or "(given sockets)", self.max_model_len,
                    self.llm.kv_capacity_tokens, self.settings.max_queue)

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
        self.begin_drain()
        if self._drain_task is not None:
            await self._drain_task
        await asyncio.to_thread(self.llm.manager.stop, 10.0)

    # -- admission --------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(self.names)}.",
                           param="model", code="model_not_found")

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

    # -- building requests ------------------------------------------------------------------
    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "prompt is empty", param="prompt")
                ids.append(self.tokenizer.encode(p))
            else:
                ids.append(list(p))
        return ids

    def render_chat(self, messages: list[ChatMessage], tools: ToolPlan | None = None) -> list[int]:
        template = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else ""
        turns, template_tools = conversation(messages, tools or ToolPlan(), template, CHAT_ROLES)
        try:
            return self.llm.render_chat(turns, tools=template_tools)
        except Exception as exc:  # no chat template, or the template rejected the conversation
            raise APIError(400, f"cannot apply the model's chat template: {exc}", param="messages") from exc

    def build_requests(self, prefix: str, prompts: list[list[int]], body: SamplingFields, max_tokens: int | None,
                       logprobs: int | None, param: str, prompt_logprobs: int | None = None,
                       constraint: tuple[StructuredOutputsParams | None, str | None] = (None, None)) -> list[Request]:
        """Engine requests (validated, constraints compiled: call it off the event loop) for the prompts x n.
        constraint: a tool choice's (constraint, field); else the body's response_format / structured_outputs."""
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
            for j in range(body.n):
                try:
                    params = SamplingParams(
                        max_new_tokens=limit, **unset,
                        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                        min_tokens=body.min_tokens, seed=None if body.seed is None else body.seed + j, stop=stop,
                        stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs, structured_outputs=structured, logit_bias=bias)
                    requests.append(self.llm.make_request(f"{prefix}-{p * body.n + j}", ids, params))
                except InvalidRequestError as exc:
                    raise request_error(exc, param, structured_param) from exc
                except (ValueError, OverflowError, RuntimeError) as exc:  # SamplingParams; torch for a bad seed
                    raise APIError(400, str(exc), param="logit_bias" if "logit_bias" in str(exc) else None) from exc
        return requests

    # -- rendering --------------------------------------------------------------------------
    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], n: int,
                            offset: int) -> dict[str, Any]:
        tokens = [self.token_str(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
                "top_logprobs": [{self.token_str(i): v for i, v in list(lp.items())[:n]} for lp in logprobs],
                "text_offset": offsets}

    def prompt_logprobs(self, entries: list[dict[int, float] | None], n: int) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}, the
        top-n first (ranked 1..n), then the prompt token if it is not among them (rank unknown: null)."""
        def entry(lp: dict[int, float]) -> dict[str, Any]:
            return {str(t): {"logprob": v, "rank": i + 1 if i < n else None, "decoded_token": self.token_str(t)}
                    for i, (t, v) in enumerate(lp.items())}

        return [None if lp is None else entry(lp) for lp in entries]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], n: int) -> list[dict[str, Any]]:
        def entry(token_id: int, value: float | None) -> dict[str, Any]:
            s = self.token_str(token_id)
            return {"token": s, "logprob": value, "bytes": list(s.encode())}

        return [entry(t, lp.get(t)) | {"top_logprobs": [entry(i, v) for i, v in list(lp.items())[:n]]}
                for t, lp in zip(token_ids, logprobs)]


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompts: Iterable[list[int]], finals: Iterable[RequestOutput | int]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(f if isinstance(f, int) else f.num_output_tokens for f in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


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
BODY_FIELDS = {"logit_bias": "logit_bias"}


def failure(out: RequestOutput) -> APIError | None:
    """The error a request that ended badly answers with (None for "stop"/"length")."""
    if out.finish_reason == "error":
        return APIError(500, f"the request failed in the engine: {out.error}", type="server_error",
                        code="engine_error")
    if out.finish_reason == "abort":
        return APIError(503, "the request was aborted (server shutting down)", type="service_unavailable_error",
                        code="request_aborted")
    return None
