"""The FastAPI app: OpenAI-compatible routes over one shared engine (see conveyor/server/__init__.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..llm import LLM
from ..request import RequestOutput
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       error_body)
from .serving import Serving, ServerSettings, Submission, failure, new_id, usage

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class SSEResponse(StreamingResponse):
    """Server-sent events; the submission is cancelled however the stream ends (client gone included)."""

    def __init__(self, content: AsyncIterator[str], submission: Submission) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submission = submission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.cancel()


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it at once if the client disconnects (as vLLM's `with_cancellation`)."""
    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


def build_app(llm: LLM, settings: ServerSettings | None = None) -> FastAPI:
    serving = Serving(llm, settings or ServerSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving.startup()
        try:
            yield
        finally:
            await serving.shutdown()

    app = FastAPI(title="Conveyor", lifespan=lifespan)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"the request body is not valid JSON: {detail}".rstrip(": "),
                                           "invalid_request_error"), 400)
        locs = [".".join(str(p) for p in e.get("loc", ())[1:]) for e in errors]  # loc[0] is "body"
        message = "; ".join(f"{loc or 'body'}: {e.get('msg')}" for loc, e in zip(locs, errors)) or "invalid request"
        param = locs[0].split(".")[0] if locs and locs[0] else None
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    async def authorize(request: Request) -> None:
        key = serving.settings.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect or missing API key (send `Authorization: Bearer KEY`).",
                           code="invalid_api_key")

    auth = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        if serving.draining or not llm.manager.is_running():
            raise APIError(503, "not serving (shutting down or engine stopped)", type="service_unavailable_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": serving.created, "owned_by": "conveyor",
             "root": str(llm.model_path), "parent": None, "max_model_len": serving.max_model_len}
            for name in serving.names]}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`")
        if body.messages is not None:
            tokens = serving.render_chat(body.messages)
        else:
            tokens = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        vocab = llm.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        serving.check_model(body.model)
        for name, bad in (("echo", body.echo), ("suffix", body.suffix),
                          ("best_of", body.best_of not in (None, body.n))):
            if bad:
                raise APIError(400, f"{name} is not supported", param=name)
        if body.stream and body.prompt_logprobs is not None:  # as vLLM
            raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        prompts = serving.completion_prompts(body)
        rid, created = new_id("cmpl"), int(time.time())
        requests = serving.build_requests(rid, prompts, body, body.max_tokens, body.logprobs, "prompt",
                                          prompt_logprobs=body.prompt_logprobs)
        sub = serving.submit(requests)
        head = {"id": rid, "object": "text_completion", "created": created, "model": serving.model_name}
        n_lp = body.logprobs

        if body.stream:
            offsets = [0] * len(requests)  # characters of text sent per choice, for logprob text offsets

            def completion_choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
                lp = None
                if n_lp is not None:
                    lp = serving.completion_logprobs(out.token_ids[start:], out.logprobs[start:], n_lp, offsets[i])
                offsets[i] += len(out.delta_text)
                return {"index": i, "text": out.delta_text, "logprobs": lp,
                        "finish_reason": out.finish_reason if out.finished else None, "stop_reason": None}

            return stream_response(sub, head, prompts, body, n_lp, completion_choice)

        finals = await collect(sub, raw)
        choices = []
        for i, out in enumerate(finals):
            lp = None if n_lp is None else serving.completion_logprobs(out.token_ids, out.logprobs, n_lp, 0)
            plp = None if out.prompt_logprobs is None else serving.prompt_logprobs(out.prompt_logprobs,
                                                                                   body.prompt_logprobs or 0)
            choices.append({"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason,
                            "stop_reason": None, "prompt_logprobs": plp})
        return JSONResponse(head | {"choices": choices, "usage": usage(prompts, finals)})

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        serving.check_model(body.model)
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        n_lp = (body.top_logprobs or 0) if body.logprobs else None
        prompt = serving.render_chat(body.messages)
        rid, created = new_id("chatcmpl"), int(time.time())
        max_tokens = body.max_completion_tokens or body.max_tokens
        requests = serving.build_requests(rid, [prompt], body, max_tokens, n_lp, "messages")
        sub = serving.submit(requests)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": serving.model_name}

        if body.stream:
            def chat_choice(i: int, out: RequestOutput, start: int) -> dict[str, Any]:
                lp = None
                if n_lp is not None:
                    lp = {"content": serving.chat_logprobs(out.token_ids[start:], out.logprobs[start:], n_lp)}
                delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
                return {"index": i, "delta": delta, "logprobs": lp,
                        "finish_reason": out.finish_reason if out.finished else None}

            roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(requests))]
            return stream_response(sub, head | {"object": "chat.completion.chunk"}, [prompt], body, n_lp,
                                   chat_choice, first_choices=roles)

        finals = await collect(sub, raw)
        choices = []
        for i, out in enumerate(finals):
            lp = None if n_lp is None else {"content": serving.chat_logprobs(out.token_ids, out.logprobs, n_lp)}
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                            "finish_reason": out.finish_reason})
        return JSONResponse(head | {"choices": choices, "usage": usage([prompt], finals)})

    return app


def stream_response(sub: Submission, head: dict[str, Any], prompts: list[list[int]], body: Any, n_lp: int | None,
                    render: Callable[[int, RequestOutput, int], dict[str, Any]],
                    first_choices: Sequence[dict[str, Any]] = ()) -> SSEResponse:
    """Server-sent events for a streaming completion or chat completion: one chunk per output that
    carries text (or logprobs, or the end), `render(i, output, first_new_token)` shaping the choice;
    an error event if a request fails; a usage chunk when asked; then [DONE]."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    async def events() -> AsyncIterator[str]:
        sent_tokens, counts = [0] * len(sub.requests), [0] * len(sub.requests)
        for choice in first_choices:
            yield sse(head | {"choices": [choice]} | extra)
        async for i, out in sub.outputs():
            counts[i] = len(out.token_ids)
            if (err := failure(out)) is not None:
                yield sse(err.body())
                break
            if not (out.delta_text or out.finished or (n_lp is not None and out.delta_token_ids)):
                continue
            start, sent_tokens[i] = sent_tokens[i], len(out.token_ids)
            yield sse(head | {"choices": [render(i, out, start)]} | extra)
        else:
            if include_usage:
                yield sse(head | {"choices": [], "usage": usage(prompts, counts)})
        yield DONE

    return SSEResponse(events(), sub)


async def collect(sub: Submission, raw: Request) -> list[RequestOutput]:
    """The final output of every request of the submission; raises the first failure's APIError.
    The submission is cancelled on the way out, whether it finished, failed or the client left."""

    async def finals() -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(sub.requests)
        async for i, out in sub.outputs():
            if out.finished:
                if (err := failure(out)) is not None:
                    raise err
                results[i] = out
        return results  # type: ignore[return-value]

    try:
        return await unless_disconnected(raw, finals())
    finally:
        sub.cancel()
