"""One response being generated, on a task of its own: it reads the engine's outputs to the end
whoever waits for it (a client, a stream, nobody for `background`), so that a response always ends
with a status and its stored entry, and a cancel always has a run to stop.

Statuses: "completed" (the model stopped), "incomplete" with `incomplete_details.reason =
"max_output_tokens"` (cut at the limit, or at the end of the context), "cancelled" (`POST
.../cancel`, `DELETE`, the client gone, or the server shutting down), "failed" (the engine failed
the request). A stream sends OpenAI's events, numbered from 0: `response.created`,
`response.in_progress`, the items' events (`items.OutputBuilder`), then `response.completed`,
`response.incomplete` or `response.failed`; a cancelled stream ends its open items and then sends
an `error` event (code `response_cancelled`, or `request_aborted` when the server shuts down),
as the SDK knows no event for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ...request import RequestOutput
from ...sampling_params import SamplingParams
from ..outcomes import failure
from ..protocol import APIError, ChatMessage
from ..replies import ReasoningPlan
from ..submission import Submission
from ..streaming import dumps
from ..tools import ToolPlan
from .items import Logprob, OutputBuilder, output_turns, reasoning_text
from .protocol import NamedFunction, ResponsesRequest
from .store import StoredResponse

logger = logging.getLogger("conveyor.server")

STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled", "error": "failed", "timeout": "failed"}
RUNNING: set[asyncio.Task[None]] = set()  # the loop holds tasks weakly: these are held until they end
END_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def response_object(response_id: str, body: ResponsesRequest, model: str, params: SamplingParams) -> dict[str, Any]:
    """The response object before any output: the request's settings as they apply (the sampling
    defaults filled in), status "in_progress"."""
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice or ("auto" if body.tools else "none")
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": body.background, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
        "store": body.store, "temperature": params.temperature, "top_p": params.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "truncation": body.truncation or "disabled", "usage": None, "user": body.user, "metadata": body.metadata or {},
        "top_logprobs": body.top_logprobs or 0, "max_tool_calls": body.max_tool_calls,
        "service_tier": body.service_tier or "auto", "prompt_cache_key": body.prompt_cache_key,
        "safety_identifier": body.safety_identifier,
    }


def usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int = 0, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object. `reasoning_tokens`: the reasoning items' text encoded again (the markers and
    the whitespace around them are not counted); `cached_tokens`: the input tokens the prefix cache held."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def token_count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


class ResponseRun:
    """The generation of one response: `record` is what the store keeps; with `stream`, `events()`
    gives the server-sent events. `failure`: after the end, the error a waiting client answers with
    (the engine failed, or the server aborted it), None otherwise. `logprobs`: with the request's
    include, the entries of new tokens from their ids and logprobs (`LogprobRenderer.chat`)."""

    def __init__(self, response: dict[str, Any], plan: ToolPlan, reasoning: ReasoningPlan, sub: Submission,
                 prompt_tokens: int, conversation: list[ChatMessage], stream: bool,
                 logprobs: Callable[[list[int], list[dict[int, float]]], list[Logprob]] | None = None) -> None:
        self.sub, self.prompt_tokens, self.conversation = sub, prompt_tokens, conversation
        self.logprobs = logprobs
        self.record = StoredResponse(response, cancel=self.cancel)
        self.response = response
        self.queue: asyncio.Queue[str | None] | None = asyncio.Queue() if stream else None
        self.builder = OutputBuilder(plan, reasoning, self.emit)  # fed as tokens come when streamed, else once
        response["output"] = self.builder.items  # GET shows a stream's output so far
        self.reasoning_tokens = 0
        self.sequence = 0
        self.cancelled = False  # by POST .../cancel or DELETE
        self.failure: APIError | None = None

    def start(self) -> None:
        self.emit({"type": "response.created", "response": self.response})
        self.emit({"type": "response.in_progress", "response": self.response})
        task = asyncio.get_running_loop().create_task(self.drive())
        RUNNING.add(task)
        task.add_done_callback(RUNNING.discard)

    def cancel(self) -> None:
        self.cancelled = True
        self.sub.cancel()

    def emit(self, event: dict[str, Any]) -> None:
        """One stream event, numbered and serialized at once (it holds live items)."""
        if self.queue is None:
            return
        self.queue.put_nowait(f"event: {event['type']}\ndata: {dumps(event | {'sequence_number': self.sequence})}\n\n")
        self.sequence += 1

    async def events(self) -> AsyncIterator[str]:
        assert self.queue is not None, "not a streamed response"
        while (event := await self.queue.get()) is not None:
            yield event

    async def drive(self) -> None:
        final: RequestOutput | None = None
        fed = 0  # the tokens whose logprobs the builder has
        try:
            async for _, out in self.sub.outputs():
                if out.finished or (self.queue is not None and out.delta_text):
                    entries = self.logprobs(out.token_ids[fed:], out.logprobs[fed:]) if self.logprobs else []
                    fed = len(out.token_ids)
                    self.builder.feed(out.text, out.finished, entries)
                final = out
            if thought := reasoning_text(self.builder.items):
                self.reasoning_tokens = await self.count(thought)
        except Exception:  # a bug: the response fails, the server goes on
            logger.exception("response %s failed", self.response["id"])
            final = None
        finally:
            self.sub.cancel()
            try:
                self.finish(final)
            finally:  # whatever happened, whoever waits is answered
                self.record.cancel = None
                self.record.done.set()
                if self.queue is not None:
                    self.queue.put_nowait(None)

    async def count(self, text: str) -> int:
        """The tokens of `text`, counted off the event loop (0 once the server has stopped its threads)."""
        serving = self.sub.serving
        try:
            return await serving.prepare(token_count, serving.tokenizer, text)
        except RuntimeError:  # the preparing threads are shut down
            return 0

    def finish(self, out: RequestOutput | None) -> None:
        """The response as it ended, its last events, and the turns a next response continues from."""
        status = STATUS[out.finish_reason or "error"] if out is not None else "failed"
        item_status = "completed" if status == "completed" else "incomplete"
        self.builder.close(item_status)
        self.response.update(status=status, usage=usage(self.prompt_tokens, out.num_output_tokens if out else 0,
                                                        self.reasoning_tokens, out.num_cached_tokens if out else 0))
        if status == "completed":
            self.response["completed_at"] = int(time.time())
        elif status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "failed":
            self.failure = (failure(out) if out is not None else None) or APIError(
                500, "the response failed in the server", type="server_error")
            self.response["error"] = {"code": "server_error", "message": self.failure.message}
        elif not self.cancelled and out is not None:  # aborted by the server (shutting down), not asked for
            self.failure = failure(out)
        if status in END_EVENT:
            self.emit({"type": END_EVENT[status], "response": self.response})
        else:
            code, message = (("response_cancelled", "the response was cancelled") if self.failure is None
                             else ("request_aborted", self.failure.message))
            self.emit({"type": "error", "code": code, "message": message, "param": None})
        self.record.history = self.conversation + output_turns(self.response["output"])
