"""How a generation reaches the client: server-sent events, or the final outputs collected.

Either way the submission's engine requests are cancelled when the HTTP exchange ends (response
sent, client gone), so their KV blocks return to the pool within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..request import RequestOutput
from .outcomes import failure
from .serving import usage
from .submission import Submission

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {dumps(obj)}\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ChunkTemplate:
    """A stream's chunk event with its constant part serialized once: `data: {head..., "choices":
    [CHOICE]}` (and `"usage": null` when the stream reports usage, or the usage so far: vLLM's
    `continuous_usage_stats`), so that a token costs the serialization of its choice only."""

    def __init__(self, head: dict[str, Any], include_usage: bool) -> None:
        whole = dumps(head | {"choices": [None]} | ({"usage": None} if include_usage else {}))
        self.prefix, self.suffix = whole.split('"choices":[null]', 1)
        self.prefix = f'data: {self.prefix}"choices":['
        self.suffix = f"]{self.suffix}\n\n"
        self.before_usage = self.suffix.removesuffix("null}\n\n")  # usage is the last key

    def __call__(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> str:
        if usage is not None:
            return self.prefix + dumps(choice) + self.before_usage + dumps(usage) + "}\n\n"
        return self.prefix + dumps(choice) + self.suffix


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class SSEResponse(StreamingResponse):
    """Server-sent events; the submission is cancelled however the stream ends (client gone included).

    The status line and headers go out with the first output (a token, the end, or an error), not
    before: until then this server has sent nothing, so when it dies with the request still queued, a
    router in front of it (`conveyor serve --data-parallel-size`) sees a failed exchange and retries the
    request on another replica instead of passing on a 200 stream that breaks off."""

    def __init__(self, content: AsyncIterator[str], submission: Submission) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submission = submission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self.submission.started.wait())
            await super().__call__(scope, receive, send)
        except ClientGone:
            pass
        finally:
            self.submission.cancel()


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it at once if the client disconnects (as vLLM's `with_cancellation`);
    ClientGone then."""
    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
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


def stream_response(sub: Submission, head: dict[str, Any], prompts: list[list[int]], body: Any, n_lp: int | None,
                    render: Callable[[int, RequestOutput, int], dict[str, Any] | None],
                    first_choices: Sequence[dict[str, Any]] = (), counts_output: bool = True,
                    usage_details: bool = False, force_usage: bool = False) -> SSEResponse:
    """Server-sent events for a streaming completion or chat completion: one chunk per output that
    carries text (or logprobs, or the end), `render(i, output, first_new_token)` shaping the choice;
    an error event if a request fails; a usage chunk when asked; then [DONE]. A render that returns
    None has nothing to send yet (a tool call still being parsed). With vLLM's
    `stream_options.continuous_usage_stats` every chunk carries the usage so far. `counts_output` False:
    the usage counts no completion tokens (an echo's, whose one token is not sent). `usage_details`: the
    usage has the cached prompt tokens (each prompt's first choice's); `force_usage`: a usage chunk even
    unasked."""
    include_usage = force_usage or bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    chunk = ChunkTemplate(head, include_usage)

    async def events() -> AsyncIterator[str]:
        sent_tokens, counts, cached = [0] * len(sub.requests), [0] * len(sub.requests), [0] * len(sub.requests)
        for choice in first_choices:
            yield chunk(choice)
        async for i, out in sub.outputs():
            counts[i] = len(out.token_ids) if counts_output else 0
            cached[i] = out.num_cached_tokens
            if (err := failure(out)) is not None:
                yield sse(err.body())
                break
            if not (out.delta_text or out.finished or (n_lp is not None and out.delta_token_ids)):
                continue
            choice = render(i, out, sent_tokens[i])
            if choice is None:
                continue
            sent_tokens[i] = len(out.token_ids)
            yield chunk(choice, usage(prompts, counts) if continuous else None)
        else:
            if include_usage:
                details = sum(cached[::body.n]) if usage_details else None
                yield sse(head | {"choices": [], "usage": usage(prompts, counts, details)})
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
        return await unless_disconnected(raw.receive, finals())
    finally:
        sub.cancel()
